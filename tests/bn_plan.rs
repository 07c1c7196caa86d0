//! The BatchNorm plan on the CPU: the whole grid of policies, implementations (with and without
//! cuDNN), shapes, fusions, phases, data types, NHWC flag, fusion switch and cuDNN versions, spot
//! checks with literal expectations, and properties over random shapes and configurations.

use nnfuse::batchnorm::{
    fused_dtype_supported, oneflow_mode, plan, BnApi, BnMode, BnPath, BnPlan, Fuse, FusedRefusal,
    OwnVariant, OwnVariantChoice, Phase, PlanRequest, DEPARTS_FROM_ONEFLOW,
};
use nnfuse::internals::batchnorm::{
    graph_supported, AutoCase, GRAPH_FOR_AUTO, OWN_FOR_CHANNELS_FIRST,
    OWN_FOR_CHANNELS_FIRST_SHORT_RUNS, OWN_FOR_CHANNELS_LAST_FUSED, OWN_FOR_CHANNELS_LAST_ON_CHIP,
    OWN_FOR_CHANNELS_LAST_PLAIN, OWN_FOR_CHANNELS_LAST_UNFUSED, OWN_FOR_INFERENCE, OWN_FOR_TWO_D,
    OWN_PERSISTENT_MAX_BYTES, OWN_PER_CHANNEL_MAX_M, PREFER_PERSISTENT,
    PREFER_PERSISTENT_CHANNELS_FIRST,
};
use nnfuse::{BnImpl, BnModePolicy, Config, CudnnApi, DType, TensorFormat};
use proptest::prelude::*;

use BnMode::*;
use TensorFormat::*;

const POLICIES: [BnModePolicy; 3] = [
    BnModePolicy::OneFlow,
    BnModePolicy::Auto,
    BnModePolicy::Fast,
];
const VERSIONS: [usize; 3] = [7400, 7401, 91900];

/// One shape of the grid and the layout OneFlow's inference must give it.
struct Case {
    what: &'static str,
    shape: &'static [usize],
    axis: usize,
    /// (n, c, h, w, format)
    layout: (i32, i32, i32, i32, TensorFormat),
}

/// One row of [`CASES`].
const fn case(
    what: &'static str,
    shape: &'static [usize],
    axis: usize,
    layout: (i32, i32, i32, i32, TensorFormat),
) -> Case {
    Case {
        what,
        shape,
        axis,
        layout,
    }
}

// One row per case: a data table, kept one line a row.
#[rustfmt::skip]
const CASES: &[Case] = &[
    case("2-D (N, C)", &[256, 1024], 1, (256, 1024, 1, 1, Nhwc)),
    case("2-D, C = 30", &[64, 30], 1, (64, 30, 1, 1, Nhwc)),
    case("2-D, axis 0, (C, M)", &[30, 7], 0, (1, 30, 7, 1, Nchw)),
    case("2-D, axis 0, (C, 1)", &[32, 1], 0, (1, 32, 1, 1, Nhwc)),
    case("1-D", &[32], 0, (1, 32, 1, 1, Nhwc)),
    case("3-D channels-first", &[8, 32, 100], 1, (8, 32, 100, 1, Nchw)),
    case("3-D channels-last", &[8, 100, 32], 2, (8, 32, 100, 1, Nhwc)),
    case("4-D channels-first", &[16, 32, 112, 112], 1, (16, 32, 12544, 1, Nchw)),
    case("4-D channels-last", &[64, 56, 56, 256], 3, (64, 256, 3136, 1, Nhwc)),
    case("4-D channels-first, C = 30", &[16, 30, 56, 56], 1, (16, 30, 3136, 1, Nchw)),
    case("4-D channels-last, C = 30", &[16, 56, 56, 30], 3, (16, 30, 3136, 1, Nhwc)),
    case("5-D channels-first", &[2, 16, 4, 8, 8], 1, (2, 16, 256, 1, Nchw)),
    case("5-D channels-last", &[2, 4, 8, 8, 16], 4, (2, 16, 256, 1, Nhwc)),
    case("axis 0", &[32, 4, 4], 0, (1, 32, 16, 1, Nchw)),
    case("axis 0, trailing ones", &[32, 1, 1], 0, (1, 32, 1, 1, Nhwc)),
    case("axis in the middle", &[4, 6, 32, 5], 2, (24, 32, 5, 1, Nchw)),
    case("axis in the middle, inner 1", &[4, 6, 32, 1], 2, (4, 32, 6, 1, Nhwc)),
    case("N = 1 channels-first", &[1, 32, 56, 56], 1, (1, 32, 3136, 1, Nchw)),
    case("N = 1 channels-last", &[1, 56, 56, 32], 3, (1, 32, 3136, 1, Nhwc)),
    case("H = W = 1 (N, C, 1, 1) infers NHWC", &[64, 32, 1, 1], 1, (64, 32, 1, 1, Nhwc)),
    case("H = W = 1, C = 30", &[64, 30, 1, 1], 1, (64, 30, 1, 1, Nhwc)),
];

fn config(policy: BnModePolicy, nhwc: bool, fusion_disabled: bool) -> Config {
    Config::default()
        .with_bn_mode_policy(policy)
        .with_nhwc(nhwc)
        .with_cudnn_fusion_disabled(fusion_disabled)
}

#[allow(clippy::too_many_arguments)]
fn make(
    shape: &[usize],
    axis: usize,
    dtype: DType,
    fuse: Fuse,
    phase: Phase,
    config: &Config,
    cudnn_version: usize,
) -> BnPlan {
    make_with(shape, axis, dtype, fuse, phase, config, cudnn_version, true)
}

#[allow(clippy::too_many_arguments)]
fn make_with(
    shape: &[usize],
    axis: usize,
    dtype: DType,
    fuse: Fuse,
    phase: Phase,
    config: &Config,
    cudnn_version: usize,
    cudnn_available: bool,
) -> BnPlan {
    plan(&PlanRequest {
        shape,
        axis,
        dtype,
        fuse,
        phase,
        config,
        cudnn_version,
        cudnn_available,
        own_variant: OwnVariantChoice::Auto,
    })
    .unwrap_or_else(|e| panic!("plan({shape:?}, axis {axis}) failed: {e}"))
}

/// The persistent kernels' structural rule as docs/BATCHNORM.md states it: channels-first runs
/// of a multiple of 32 elements; channels-last rows of a power-of-two number (up to 512) of
/// 16-byte vectors.
fn persistent_structure(l: &nnfuse::ChannelLayout, dtype: DType) -> bool {
    match l.format {
        Nchw => (l.h * l.w) % 32 == 0,
        Nhwc => {
            let per_vec = 16 / dtype.size() as i32;
            l.c % per_vec == 0 && (l.c / per_vec).count_ones() == 1 && l.c / per_vec <= 512
        }
    }
}

/// Whether `tiles` copies of the tensor (1: x; 2: x and dy) fit the persistent budget.
fn fits(l: &nnfuse::ChannelLayout, dtype: DType, tiles: u64) -> bool {
    l.numel() as u64 * dtype.size() as u64 * tiles <= OWN_PERSISTENT_MAX_BYTES
}

/// The implementation as the brief states it: no cuDNN or `own` → own; `cudnn` → cuDNN; the
/// oneflow policy → cuDNN; auto → the table's row.
#[allow(clippy::too_many_arguments)]
fn expected_own(
    l: &nnfuse::ChannelLayout,
    policy: BnModePolicy,
    bn_impl: BnImpl,
    available: bool,
    fuse: Fuse,
    phase: Phase,
    dtype: DType,
    refusals: &[FusedRefusal],
) -> bool {
    if !available {
        return true;
    }
    match bn_impl {
        BnImpl::Own => true,
        BnImpl::Cudnn => false,
        BnImpl::Auto if policy == BnModePolicy::OneFlow => false,
        BnImpl::Auto => {
            if phase == Phase::Inference {
                OWN_FOR_INFERENCE
            } else if l.format == Nchw {
                // Runs of at least one 16-byte vector: the own kernels' vector path.
                if l.h * l.w * dtype.size() as i32 >= 16 {
                    OWN_FOR_CHANNELS_FIRST
                } else {
                    OWN_FOR_CHANNELS_FIRST_SHORT_RUNS
                }
            } else if l.h * l.w == 1 {
                OWN_FOR_TWO_D
            } else if persistent_structure(l, dtype) && fits(l, dtype, 2) {
                OWN_FOR_CHANNELS_LAST_ON_CHIP
            } else if fuse == Fuse::None {
                OWN_FOR_CHANNELS_LAST_PLAIN
            } else if refusals.is_empty() {
                OWN_FOR_CHANNELS_LAST_FUSED
            } else {
                OWN_FOR_CHANNELS_LAST_UNFUSED
            }
        }
    }
}

/// Whether the auto choice prefers the persistent variant for `l` (channels-first input with
/// runs of more than one element has its own constant).
fn prefer(l: &nnfuse::ChannelLayout) -> bool {
    if l.format == nnfuse::TensorFormat::Nchw && l.h * l.w > 1 {
        PREFER_PERSISTENT_CHANNELS_FIRST
    } else {
        PREFER_PERSISTENT
    }
}

/// The own variant of one training direction under the auto choice: the backward of few values
/// per channel per channel in f64; else persistent where preferred, structured and fitting.
fn expected_variant(l: &nnfuse::ChannelLayout, dtype: DType, tiles: u64) -> OwnVariant {
    if tiles == 2 && l.per_channel() as u64 <= OWN_PER_CHANNEL_MAX_M {
        OwnVariant::PerChannel
    } else if prefer(l) && persistent_structure(l, dtype) && fits(l, dtype, tiles) {
        OwnVariant::Persistent
    } else {
        OwnVariant::TwoPass
    }
}

/// The mode as the brief states it, case by case (not the implementation's code path).
fn expected_mode(
    policy: BnModePolicy,
    rank: usize,
    h: i32,
    format: TensorFormat,
    phase: Phase,
    nhwc: bool,
) -> BnMode {
    let flag = if nhwc { SpatialPersistent } else { Spatial };
    match policy {
        // Exactly OneFlow's rule, except that PER_ACTIVATION is not taken where it would not
        // be BatchNorm (rank 2 with h > 1: channel on axis 0 of (C, M)).
        BnModePolicy::OneFlow if rank == 2 && h == 1 => PerActivation,
        BnModePolicy::OneFlow => flag,
        BnModePolicy::Auto if rank == 2 => SpatialPersistent,
        BnModePolicy::Auto if format == Nhwc && phase == Phase::Training => SpatialPersistent,
        BnModePolicy::Auto => flag,
        BnModePolicy::Fast => SpatialPersistent,
    }
}

/// (implementation setting, cuDNN loadable) pairs of the grid.
const IMPLS: [(BnImpl, bool); 4] = [
    (BnImpl::Auto, true),
    (BnImpl::Cudnn, true),
    (BnImpl::Own, true),
    (BnImpl::Auto, false),
];

#[test]
fn the_whole_grid() {
    let mut plans = 0usize;
    let mut fused = 0usize;
    let mut own = 0usize;
    let mut persistent = 0usize;
    for case in CASES {
        for policy in POLICIES {
            for nhwc in [false, true] {
                for disabled in [false, true] {
                    for fuse in Fuse::ALL {
                        for phase in Phase::ALL {
                            for dtype in DType::ALL {
                                for version in VERSIONS {
                                    for (bn_impl, available) in IMPLS {
                                        let cfg =
                                            config(policy, nhwc, disabled).with_bn_impl(bn_impl);
                                        let p = make_with(
                                            case.shape, case.axis, dtype, fuse, phase, &cfg,
                                            version, available,
                                        );
                                        let ctx = format!(
                                            "{} {:?} axis {}: {policy} nhwc={nhwc} \
                                             disabled={disabled} {fuse} {phase} {dtype} cuDNN \
                                             {version} impl={bn_impl} cudnn={available}\n{p}",
                                            case.what, case.shape, case.axis
                                        );
                                        check_one(
                                            case, policy, nhwc, disabled, fuse, phase, dtype,
                                            version, bn_impl, available, &p, &ctx,
                                        );
                                        plans += 1;
                                        fused += (p.path == BnPath::CudnnFused) as usize;
                                        own += (p.path == BnPath::Own) as usize;
                                        persistent += (p.own_forward
                                            == Some(OwnVariant::Persistent))
                                            as usize;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    assert_eq!(plans, CASES.len() * 3 * 2 * 2 * 3 * 2 * 3 * 3 * IMPLS.len());
    assert!(fused > 0, "the grid must reach the fused path");
    assert!(own > 0, "the grid must reach the own path");
    assert_eq!(
        persistent > 0,
        PREFER_PERSISTENT || PREFER_PERSISTENT_CHANNELS_FIRST,
        "the grid reaches the persistent variant exactly when it is preferred"
    );
}

#[allow(clippy::too_many_arguments)]
fn check_one(
    case: &Case,
    policy: BnModePolicy,
    nhwc: bool,
    disabled: bool,
    fuse: Fuse,
    phase: Phase,
    dtype: DType,
    version: usize,
    bn_impl: BnImpl,
    available: bool,
    p: &BnPlan,
    ctx: &str,
) {
    let l = &p.layout;
    assert_eq!((l.n, l.c, l.h, l.w, l.format), case.layout, "layout: {ctx}");
    assert_eq!(l.rank, case.shape.len(), "{ctx}");
    let (_, c, h, _, format) = case.layout;
    let rank = case.shape.len();

    // Mode.
    let mode = expected_mode(policy, rank, h, format, phase, nhwc);
    assert_eq!(p.mode, mode, "mode: {ctx}");

    // Refusals, in the documented order, every one that applies.
    let mut refusals = Vec::new();
    if fuse == Fuse::None {
        refusals.push(FusedRefusal::NoActivation);
    } else {
        if phase == Phase::Inference {
            refusals.push(FusedRefusal::Inference);
        }
        if disabled {
            refusals.push(FusedRefusal::DisabledByConfig);
        }
        if format != Nhwc {
            refusals.push(FusedRefusal::NotNhwc);
        }
        if mode != SpatialPersistent {
            refusals.push(FusedRefusal::NotPersistent(mode));
        }
        if fuse == Fuse::AddRelu && c % 4 != 0 {
            refusals.push(FusedRefusal::ChannelsNotMultipleOf4(c));
        }
        if !available {
            refusals.push(FusedRefusal::CudnnMissing);
        } else if version < 7401 {
            refusals.push(FusedRefusal::CudnnTooOld(version));
        }
    }
    assert_eq!(p.refusals, refusals, "refusals: {ctx}");

    // Implementation and path.
    let own = expected_own(l, policy, bn_impl, available, fuse, phase, dtype, &refusals);
    let path = match (own, fuse, refusals.is_empty()) {
        (true, _, _) => BnPath::Own,
        (false, Fuse::None, _) => BnPath::Plain,
        (false, _, true) => BnPath::CudnnFused,
        (false, _, false) => BnPath::Fallback,
    };
    assert_eq!(p.path, path, "path: {ctx}");
    assert_eq!(
        (p.bn_impl, p.cudnn_available),
        (bn_impl, available),
        "{ctx}"
    );
    if !own {
        assert!(available, "{ctx}");
        assert!(
            !(policy == BnModePolicy::OneFlow && bn_impl == BnImpl::Auto) || path != BnPath::Own,
            "{ctx}"
        );
    }

    // Own variants: inference one elementwise pass; training persistent when the structure
    // allows it and x (forward) / x and dy (backward) fit the budget.
    let (fwd, bwd) = match (own, phase) {
        (false, _) => (None, None),
        (true, Phase::Inference) => (Some(OwnVariant::Elementwise), None),
        (true, Phase::Training) => (
            Some(expected_variant(l, dtype, 1)),
            Some(expected_variant(l, dtype, 2)),
        ),
    };
    assert_eq!(
        (p.own_forward, p.own_backward),
        (fwd, bwd),
        "own variants: {ctx}"
    );

    // API: none without cuDNN; Ex exactly for persistent training on a cuDNN that has it.
    let api = if !available {
        BnApi::None
    } else if phase == Phase::Training && mode == SpatialPersistent && version >= 7401 {
        BnApi::Ex
    } else {
        BnApi::Legacy
    };
    assert_eq!(p.api, api, "api: {ctx}");
    if p.path == BnPath::CudnnFused {
        assert_eq!(p.api, BnApi::Ex, "{ctx}");
    }

    // Echoed inputs.
    assert_eq!((p.fuse, p.phase, p.dtype), (fuse, phase, dtype), "{ctx}");
    assert_eq!(
        (p.policy, p.enable_nhwc, p.cudnn_version),
        (policy, nhwc, version),
        "{ctx}"
    );

    // Reasons: layout first, the mode line, one departure line exactly when the mode is not
    // OneFlow's, the API and path lines, one line per refusal.
    assert!(p.reasons[0].starts_with("layout: "), "{ctx}");
    assert!(
        p.reasons[0].contains(&format!(
            "{} n={} c={} h={}",
            format.name().to_uppercase(),
            l.n,
            l.c,
            l.h
        )),
        "{ctx}"
    );
    assert!(
        p.reasons[1].starts_with(&format!("mode: {}", mode.cudnn_name())),
        "{ctx}"
    );
    let departures = p
        .reasons
        .iter()
        .filter(|r| r.contains(DEPARTS_FROM_ONEFLOW))
        .count();
    let oneflow = oneflow_mode(rank, nhwc);
    assert_eq!(departures, (mode != oneflow) as usize, "departures: {ctx}");
    assert_eq!(p.departs_from_oneflow(), mode != oneflow, "{ctx}");
    // Against the plan under the oneflow policy: a different mode is always explained.
    let of = make(
        case.shape,
        case.axis,
        dtype,
        fuse,
        phase,
        &config(BnModePolicy::OneFlow, nhwc, disabled),
        version,
    );
    if p.mode != of.mode {
        assert_eq!(departures, 1, "{ctx}");
    }
    assert_eq!(
        p.reasons.iter().filter(|r| r.starts_with("api: ")).count(),
        1,
        "{ctx}"
    );
    assert_eq!(
        p.reasons.iter().filter(|r| r.starts_with("path: ")).count(),
        1,
        "{ctx}"
    );
    let impl_lines: Vec<&String> = p
        .reasons
        .iter()
        .filter(|r| r.starts_with("impl: "))
        .collect();
    assert_eq!(impl_lines.len(), 1, "{ctx}");
    assert!(
        impl_lines[0].starts_with(if own { "impl: own" } else { "impl: cuDNN" }),
        "{ctx}"
    );
    if bn_impl == BnImpl::Auto && available && policy != BnModePolicy::OneFlow {
        // auto's reason names its row and cites the measurements.
        assert!(
            impl_lines[0].contains("auto, case ") && impl_lines[0].contains("docs/PERFORMANCE.md"),
            "{ctx}"
        );
    }
    let own_lines = p.reasons.iter().filter(|r| r.starts_with("own ")).count();
    if own {
        assert_eq!(
            own_lines,
            if phase == Phase::Training { 2 } else { 1 },
            "{ctx}"
        );
        assert!(
            !p.reasons.iter().any(|r| r.starts_with("not fused: ")),
            "{ctx}"
        );
    } else {
        assert_eq!(own_lines, 0, "{ctx}");
        for r in &p.refusals {
            let line = format!("not fused: {r}");
            assert_eq!(
                p.reasons.iter().filter(|x| **x == line).count(),
                1,
                "refusal line {r:?}: {ctx}"
            );
        }
    }
    // One `cuDNN API:` line (graph or legacy; under the default `auto` the graph route is
    // taken only where GRAPH_FOR_AUTO is on).
    let api_lines: Vec<&String> = p
        .reasons
        .iter()
        .filter(|r| r.starts_with("cuDNN API: "))
        .collect();
    assert_eq!(api_lines.len(), 1, "{ctx}");
    if !available {
        assert_eq!(
            api_lines[0], "cuDNN API: none — cuDNN cannot be loaded",
            "{ctx}"
        );
    }
    if !GRAPH_FOR_AUTO {
        assert!(!p.cudnn_graph, "{ctx}");
        assert!(!p.refusals.contains(&FusedRefusal::GraphApi), "{ctx}");
    }
    let expected_len = 6 + departures + if own { own_lines } else { p.refusals.len() };
    assert_eq!(p.reasons.len(), expected_len, "{ctx}");

    // JSON says the same.
    let j = p.to_json();
    assert_eq!(j["mode"], mode.name(), "{ctx}");
    assert_eq!(j["format"], format.name(), "{ctx}");
    assert_eq!(
        (
            j["n"].as_i64(),
            j["c"].as_i64(),
            j["h"].as_i64(),
            j["w"].as_i64()
        ),
        (
            Some(l.n as i64),
            Some(l.c as i64),
            Some(l.h as i64),
            Some(1)
        ),
        "{ctx}"
    );
    assert_eq!(j["path"], path.name(), "{ctx}");
    assert_eq!(j["api"], api.name(), "{ctx}");
    assert_eq!(j["fuse"], fuse.name(), "{ctx}");
    assert_eq!(j["phase"], phase.name(), "{ctx}");
    assert_eq!(j["dtype"], dtype.name(), "{ctx}");
    assert_eq!(j["policy"], policy.name(), "{ctx}");
    assert_eq!(j["enable_nhwc"], nhwc, "{ctx}");
    assert_eq!(j["cudnn_version"], version, "{ctx}");
    let codes: Vec<&str> = refusals.iter().map(FusedRefusal::code).collect();
    assert_eq!(j["refusals"], serde_json::json!(codes), "{ctx}");
    assert_eq!(j["reasons"], serde_json::json!(p.reasons), "{ctx}");
    assert_eq!(j["impl"], if own { "own" } else { "cudnn" }, "{ctx}");
    assert_eq!(j["bn_impl"], bn_impl.name(), "{ctx}");
    assert_eq!(j["cudnn_available"], available, "{ctx}");
    assert_eq!(
        j["own_forward"],
        serde_json::json!(fwd.map(|v| v.name())),
        "{ctx}"
    );
    assert_eq!(
        j["own_backward"],
        serde_json::json!(bwd.map(|v| v.name())),
        "{ctx}"
    );
}

// ---- spot checks with literal expectations ----

fn spot(shape: &[usize], axis: usize, fuse: Fuse, phase: Phase, cfg: &Config) -> BnPlan {
    make(shape, axis, DType::F16, fuse, phase, cfg, 91900)
}

/// The default configuration with the cuDNN implementation forced (the spot checks of cuDNN's
/// rules).
fn cudnn() -> Config {
    Config::default().with_bn_impl(BnImpl::Cudnn)
}

#[test]
fn channels_last_add_relu_is_fused() {
    let p = spot(
        &[64, 56, 56, 256],
        3,
        Fuse::AddRelu,
        Phase::Training,
        &cudnn(),
    );
    assert_eq!(
        (p.mode, p.api, p.path),
        (SpatialPersistent, BnApi::Ex, BnPath::CudnnFused)
    );
    assert!(p.refusals.is_empty());
    assert!(p
        .reasons
        .iter()
        .any(|r| r.contains("CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION")));
    assert!(p
        .reasons
        .iter()
        .any(|r| r.contains("departs from OneFlow") && r.contains("1.6–7.9 ms")));
}

#[test]
fn channels_first_cudnn_falls_back_with_two_refusals() {
    let p = spot(
        &[16, 32, 112, 112],
        1,
        Fuse::AddRelu,
        Phase::Training,
        &cudnn(),
    );
    assert_eq!(
        (p.mode, p.api, p.path),
        (Spatial, BnApi::Legacy, BnPath::Fallback)
    );
    assert_eq!(
        p.refusals,
        vec![FusedRefusal::NotNhwc, FusedRefusal::NotPersistent(Spatial)]
    );
    assert!(!p.departs_from_oneflow());
    // The mode line tells how to opt in to the faster mode, and why it is not the default.
    assert!(
        p.reasons[1].contains("NNFUSE_ENABLE_NHWC") && p.reasons[1].contains("1e-6"),
        "{p}"
    );
}

#[test]
fn every_refusal_at_once_in_order() {
    let cfg = cudnn().with_cudnn_fusion_disabled(true);
    let p = make(
        &[16, 30, 56, 56],
        1,
        DType::BF16,
        Fuse::AddRelu,
        Phase::Inference,
        &cfg,
        7400,
    );
    assert_eq!(
        p.refusals,
        vec![
            FusedRefusal::Inference,
            FusedRefusal::DisabledByConfig,
            FusedRefusal::NotNhwc,
            FusedRefusal::NotPersistent(Spatial),
            FusedRefusal::ChannelsNotMultipleOf4(30),
            FusedRefusal::CudnnTooOld(7400),
        ]
    );
    assert_eq!(p.path, BnPath::Fallback);
    let codes: Vec<&str> = p.refusals.iter().map(FusedRefusal::code).collect();
    assert_eq!(
        codes,
        [
            "inference",
            "disabled_by_config",
            "not_nhwc",
            "not_persistent",
            "channels_not_multiple_of_4",
            "cudnn_too_old"
        ]
    );
}

#[test]
fn relu_is_fused_at_c_30_add_relu_is_not() {
    let cfg = cudnn();
    let relu = spot(&[16, 56, 56, 30], 3, Fuse::Relu, Phase::Training, &cfg);
    assert_eq!(relu.path, BnPath::CudnnFused);
    let add = spot(&[16, 56, 56, 30], 3, Fuse::AddRelu, Phase::Training, &cfg);
    assert_eq!(add.path, BnPath::Fallback);
    // Under auto, the unfusable request is the table's channels_last_unfused row, the fusable
    // one its channels_last_fused row.
    let auto = Config::default();
    let add_auto = spot(&[16, 56, 56, 30], 3, Fuse::AddRelu, Phase::Training, &auto);
    let own_or = |own: bool, p: BnPath| if own { BnPath::Own } else { p };
    assert_eq!(
        add_auto.path,
        own_or(OWN_FOR_CHANNELS_LAST_UNFUSED, BnPath::Fallback)
    );
    assert!(add_auto
        .reasons
        .iter()
        .any(|r| r.contains("channels_last_unfused")));
    assert_eq!(
        spot(&[16, 56, 56, 30], 3, Fuse::Relu, Phase::Training, &auto).path,
        own_or(OWN_FOR_CHANNELS_LAST_FUSED, BnPath::CudnnFused)
    );
    assert_eq!(add.refusals, vec![FusedRefusal::ChannelsNotMultipleOf4(30)]);
    assert!(add
        .reasons
        .iter()
        .any(|r| r.contains("C % 4 == 0") && r.contains("C = 30")));
    let add32 = spot(&[16, 56, 56, 32], 3, Fuse::AddRelu, Phase::Training, &cfg);
    assert_eq!(add32.path, BnPath::CudnnFused);
}

#[test]
fn two_d_under_each_policy() {
    let of = Config::default().with_bn_mode_policy(BnModePolicy::OneFlow);
    let p = spot(&[65536, 256], 1, Fuse::Relu, Phase::Training, &of);
    assert_eq!(
        (p.mode, p.api, p.path),
        (PerActivation, BnApi::Legacy, BnPath::Fallback)
    );
    assert_eq!(p.refusals, vec![FusedRefusal::NotPersistent(PerActivation)]);
    assert!(!p.departs_from_oneflow());
    // Even with the NHWC flag: OneFlow's rank-2 rule comes first.
    let p = spot(
        &[65536, 256],
        1,
        Fuse::None,
        Phase::Training,
        &of.clone().with_nhwc(true),
    );
    assert_eq!(p.mode, PerActivation);

    for policy in [BnModePolicy::Auto, BnModePolicy::Fast] {
        let cfg = Config::default().with_bn_mode_policy(policy);
        for phase in Phase::ALL {
            let p = spot(&[65536, 256], 1, Fuse::Relu, phase, &cfg);
            assert_eq!(p.mode, SpatialPersistent, "{p}");
            let dep = p
                .reasons
                .iter()
                .find(|r| r.contains(DEPARTS_FROM_ONEFLOW))
                .unwrap();
            assert!(dep.contains("7.0 ms") && dep.contains("95 µs"), "{dep}");
        }
        let p = spot(&[65536, 256], 1, Fuse::Relu, Phase::Training, &cfg);
        let path = if OWN_FOR_TWO_D {
            BnPath::Own
        } else {
            BnPath::CudnnFused
        };
        assert_eq!((p.api, p.path), (BnApi::Ex, path));
        assert!(p.reasons.iter().any(|r| r.contains("case two_d")), "{p}");
        let p = spot(
            &[65536, 256],
            1,
            Fuse::Relu,
            Phase::Training,
            &cfg.clone().with_bn_impl(BnImpl::Cudnn),
        );
        assert_eq!((p.api, p.path), (BnApi::Ex, BnPath::CudnnFused));
    }
}

#[test]
fn rank_2_with_channel_on_axis_0_never_takes_per_activation() {
    // (C, M) with the channel on axis 0: PER_ACTIVATION would normalise every (c, m) alone.
    for nhwc in [false, true] {
        let cfg = Config::default()
            .with_bn_mode_policy(BnModePolicy::OneFlow)
            .with_nhwc(nhwc);
        let p = spot(&[30, 7], 0, Fuse::None, Phase::Training, &cfg);
        assert_eq!(p.mode, if nhwc { SpatialPersistent } else { Spatial });
        let dep = p
            .reasons
            .iter()
            .find(|r| r.contains(DEPARTS_FROM_ONEFLOW))
            .unwrap();
        assert!(dep.contains("not BatchNorm"), "{dep}");
    }
    // (C, 1): one position per channel, PER_ACTIVATION is per channel; OneFlow's rule stands.
    let cfg = Config::default().with_bn_mode_policy(BnModePolicy::OneFlow);
    assert_eq!(
        spot(&[30, 1], 0, Fuse::None, Phase::Training, &cfg).mode,
        PerActivation
    );
}

#[test]
fn unit_spatial_dims_infer_nhwc_and_auto_trains_persistent() {
    let p = spot(&[64, 32, 1, 1], 1, Fuse::AddRelu, Phase::Training, &cudnn());
    assert_eq!(p.layout.format, Nhwc);
    assert_eq!(
        (p.mode, p.api, p.path),
        (SpatialPersistent, BnApi::Ex, BnPath::CudnnFused)
    );
    // Under auto, (N, C, 1, 1) is the 2-D row of the table.
    let p = spot(
        &[64, 32, 1, 1],
        1,
        Fuse::AddRelu,
        Phase::Training,
        &Config::default(),
    );
    let want = if OWN_FOR_TWO_D {
        BnPath::Own
    } else {
        BnPath::CudnnFused
    };
    assert_eq!(p.path, want, "{p}");
    assert!(p.reasons.iter().any(|r| r.contains("case two_d")), "{p}");
}

#[test]
fn channels_last_inference_follows_the_flag_under_auto() {
    let off = spot(
        &[64, 56, 56, 256],
        3,
        Fuse::Relu,
        Phase::Inference,
        &cudnn(),
    );
    assert_eq!(
        (off.mode, off.api, off.path),
        (Spatial, BnApi::Legacy, BnPath::Fallback)
    );
    assert!(!off.departs_from_oneflow());
    let on = spot(
        &[64, 56, 56, 256],
        3,
        Fuse::Relu,
        Phase::Inference,
        &cudnn().with_nhwc(true),
    );
    assert_eq!((on.mode, on.api), (SpatialPersistent, BnApi::Legacy));
    assert_eq!(on.refusals, vec![FusedRefusal::Inference]);
    // Under auto, inference is the table's inference row: one pass of the own kernels when
    // OWN_FOR_INFERENCE (the mode is what cuDNN would use either way).
    let own = spot(
        &[64, 56, 56, 256],
        3,
        Fuse::Relu,
        Phase::Inference,
        &Config::default(),
    );
    if OWN_FOR_INFERENCE {
        assert_eq!((own.mode, own.path), (Spatial, BnPath::Own));
        assert_eq!(
            (own.own_forward, own.own_backward),
            (Some(OwnVariant::Elementwise), None)
        );
    } else {
        assert_eq!((own.mode, own.path), (Spatial, BnPath::Fallback));
    }
}

#[test]
fn nhwc_flag_and_fast_policy_on_channels_first() {
    let flag = spot(
        &[16, 32, 112, 112],
        1,
        Fuse::None,
        Phase::Training,
        &cudnn().with_nhwc(true),
    );
    assert_eq!(
        (flag.mode, flag.api, flag.path),
        (SpatialPersistent, BnApi::Ex, BnPath::Plain)
    );
    assert!(!flag.departs_from_oneflow());
    let fast = spot(
        &[16, 32, 112, 112],
        1,
        Fuse::None,
        Phase::Training,
        &Config::default().with_bn_mode_policy(BnModePolicy::Fast),
    );
    assert_eq!((fast.mode, fast.api), (SpatialPersistent, BnApi::Ex));
    let dep = fast
        .reasons
        .iter()
        .find(|r| r.contains(DEPARTS_FROM_ONEFLOW))
        .unwrap();
    assert!(dep.contains("2–7x") && dep.contains("1e-6"), "{dep}");
}

#[test]
fn cudnn_version_boundary() {
    let cfg = cudnn();
    let new = make(
        &[64, 56, 56, 256],
        3,
        DType::F32,
        Fuse::Relu,
        Phase::Training,
        &cfg,
        7401,
    );
    assert_eq!((new.api, new.path), (BnApi::Ex, BnPath::CudnnFused));
    let old = make(
        &[64, 56, 56, 256],
        3,
        DType::F32,
        Fuse::Relu,
        Phase::Training,
        &cfg,
        7400,
    );
    assert_eq!(
        (old.mode, old.api, old.path),
        (SpatialPersistent, BnApi::Legacy, BnPath::Fallback)
    );
    assert_eq!(old.refusals, vec![FusedRefusal::CudnnTooOld(7400)]);
    assert!(old
        .reasons
        .iter()
        .any(|r| r.starts_with("api: legacy") && r.contains("predates")));
}

#[test]
fn fusion_switch_refuses_alone() {
    let cfg = cudnn().with_cudnn_fusion_disabled(true);
    let p = spot(&[64, 56, 56, 256], 3, Fuse::AddRelu, Phase::Training, &cfg);
    assert_eq!(p.refusals, vec![FusedRefusal::DisabledByConfig]);
    assert_eq!(
        (p.mode, p.api, p.path),
        (SpatialPersistent, BnApi::Ex, BnPath::Fallback)
    );
    assert!(p
        .reasons
        .iter()
        .any(|r| r.contains("NNFUSE_DISABLE_CUDNN_FUSION")));
}

#[test]
fn no_activation_is_plain() {
    let p = spot(
        &[64, 56, 56, 256],
        3,
        Fuse::None,
        Phase::Training,
        &Config::default(),
    );
    assert_eq!(p.path, BnPath::Plain);
    assert_eq!(p.refusals, vec![FusedRefusal::NoActivation]);
}

#[test]
fn every_dtype_is_fused_today() {
    for d in DType::ALL {
        assert!(fused_dtype_supported(d), "{d}");
        let p = make(
            &[16, 112, 112, 32],
            3,
            d,
            Fuse::AddRelu,
            Phase::Training,
            &cudnn(),
            91900,
        );
        assert_eq!(p.path, BnPath::CudnnFused, "{d}");
    }
    let shown = FusedRefusal::DTypeUnsupported(DType::BF16).to_string();
    assert!(shown.contains("bf16"), "{shown}");
}

#[test]
fn refusals_explain_themselves() {
    let r = FusedRefusal::NotPersistent(Spatial).to_string();
    assert!(
        r.contains("CUDNN_BATCHNORM_SPATIAL_PERSISTENT") && r.contains("NOT_SUPPORTED"),
        "{r}"
    );
    assert!(FusedRefusal::NotNhwc.to_string().contains("NCHW"));
    assert!(FusedRefusal::CudnnTooOld(7000)
        .to_string()
        .contains("7.4.1"));
    assert!(FusedRefusal::Inference.to_string().contains("training"));
}

#[test]
fn invalid_shapes_name_the_argument() {
    let cfg = Config::default();
    let try_plan = |shape: &[usize], axis: usize| {
        plan(&PlanRequest {
            shape,
            axis,
            dtype: DType::F32,
            fuse: Fuse::Relu,
            phase: Phase::Training,
            config: &cfg,
            cudnn_version: 91900,
            cudnn_available: true,
            own_variant: OwnVariantChoice::Auto,
        })
        .unwrap_err()
    };
    assert_eq!(try_plan(&[], 0).argument(), Some("shape"));
    assert_eq!(try_plan(&[2, 3], 2).argument(), Some("axis"));
    assert_eq!(try_plan(&[2, 0, 3], 1).argument(), Some("shape[1]"));
    assert_eq!(try_plan(&[1 << 16, 1 << 16], 1).argument(), Some("shape"));
}

// ---- nnfuse's own kernels ----

#[test]
fn channels_first_default_follows_the_table() {
    // f16 32x32x112x112: x is 25.7 MB (fits the persistent budget forward), x and dy 51 MB
    // (two-pass backward whatever is preferred).
    let p = spot(
        &[32, 32, 112, 112],
        1,
        Fuse::AddRelu,
        Phase::Training,
        &Config::default(),
    );
    let own_path = |own: bool, cudnn: BnPath| if own { BnPath::Own } else { cudnn };
    assert_eq!(
        p.path,
        own_path(OWN_FOR_CHANNELS_FIRST, BnPath::Fallback),
        "{p}"
    );
    assert!(p.reasons.iter().any(|r| r.contains("case channels_first:")
        && r.contains("9–17%")
        && r.contains("docs/PERFORMANCE.md")));
    if OWN_FOR_CHANNELS_FIRST {
        let fwd = if PREFER_PERSISTENT_CHANNELS_FIRST {
            OwnVariant::Persistent
        } else {
            OwnVariant::TwoPass
        };
        assert_eq!(
            (p.own_forward, p.own_backward),
            (Some(fwd), Some(OwnVariant::TwoPass))
        );
        assert!(p
            .reasons
            .iter()
            .any(|r| r.starts_with("own backward: two-pass")));
        let j = p.to_json();
        assert_eq!(
            (&j["impl"], &j["own_forward"], &j["own_backward"]),
            (
                &serde_json::json!("own"),
                &serde_json::json!(fwd.name()),
                &serde_json::json!("two_pass")
            )
        );
    }
    // The f16 64x64x112x112 (103 MB): two-pass both ways on the own path.
    let big = spot(
        &[64, 64, 112, 112],
        1,
        Fuse::Relu,
        Phase::Training,
        &Config::default(),
    );
    assert_eq!(big.path, own_path(OWN_FOR_CHANNELS_FIRST, BnPath::Fallback));
    if big.path == BnPath::Own {
        assert_eq!(
            (big.own_forward, big.own_backward),
            (Some(OwnVariant::TwoPass), Some(OwnVariant::TwoPass))
        );
    }
    // Runs of 196 elements are not whole mask words: never persistent, even when asked for.
    let odd = make_with(
        &[2, 8, 14, 14],
        1,
        DType::F16,
        Fuse::Relu,
        Phase::Training,
        &Config::default().with_bn_impl(BnImpl::Own),
        91900,
        true,
    );
    assert_eq!(odd.own_forward, Some(OwnVariant::TwoPass));
    // Runs of 4 f16 elements (8 bytes) are the short-runs row, runs of 4 f32 elements not.
    let short = spot(
        &[64, 512, 2, 2],
        1,
        Fuse::Relu,
        Phase::Training,
        &Config::default(),
    );
    assert!(
        short
            .reasons
            .iter()
            .any(|r| r.contains("case channels_first_short_runs:")),
        "{short}"
    );
    assert_eq!(
        short.path,
        own_path(OWN_FOR_CHANNELS_FIRST_SHORT_RUNS, BnPath::Fallback)
    );
    let f32_runs = make(
        &[64, 512, 2, 2],
        1,
        DType::F32,
        Fuse::Relu,
        Phase::Training,
        &Config::default(),
        91900,
    );
    assert!(f32_runs
        .reasons
        .iter()
        .any(|r| r.contains("case channels_first:")));
}

#[test]
fn without_cudnn_every_plan_is_own() {
    let cfg = Config::default().with_bn_impl(BnImpl::Cudnn); // even when cuDNN is asked for
    for (shape, axis) in [
        (&[64usize, 56, 56, 256][..], 3usize),
        (&[16, 32, 112, 112], 1),
        (&[65536, 256], 1),
        (&[6, 20], 0),
    ] {
        for fuse in Fuse::ALL {
            for phase in Phase::ALL {
                let p = make_with(shape, axis, DType::BF16, fuse, phase, &cfg, 91900, false);
                assert_eq!(p.path, BnPath::Own, "{p}");
                assert!(!p.cudnn_available);
                assert!(p
                    .reasons
                    .iter()
                    .any(|r| r.starts_with("impl: own — cuDNN cannot")));
                assert!(p.reasons.iter().any(|r| r.starts_with("api: none")));
                // The field says the same as the reason: no cuDNN entry point runs.
                assert_eq!(p.api, BnApi::None, "{p}");
                assert_eq!(p.to_json()["api"], "none", "{p}");
                assert!(p.to_string().contains("  api    : none"), "{p}");
                assert!(p.to_string().contains("cuDNN missing"), "{p}");
                if fuse != Fuse::None {
                    assert_eq!(p.refusals.last(), Some(&FusedRefusal::CudnnMissing));
                }
            }
        }
    }
}

#[test]
fn oneflow_policy_keeps_cudnn_unless_own_is_forced() {
    let of = Config::default().with_bn_mode_policy(BnModePolicy::OneFlow);
    for phase in Phase::ALL {
        let p = spot(&[16, 32, 112, 112], 1, Fuse::Relu, phase, &of);
        assert_eq!(p.path, BnPath::Fallback, "{p}");
        assert!(p
            .reasons
            .iter()
            .any(|r| r.contains("oneflow policy keeps OneFlow's choice")));
        let p = spot(
            &[16, 32, 112, 112],
            1,
            Fuse::Relu,
            phase,
            &of.clone().with_bn_impl(BnImpl::Own),
        );
        assert_eq!(p.path, BnPath::Own, "{p}");
        // The mode is still OneFlow's (what cuDNN would run): no departure.
        assert!(!p.departs_from_oneflow());
    }
}

#[test]
fn auto_table_reaches_every_row() {
    let cfg = Config::default();
    let case_of = |shape: &[usize], axis, fuse, phase, dtype, cfg: &Config| {
        let p = make(shape, axis, dtype, fuse, phase, cfg, 91900);
        let line = p
            .reasons
            .iter()
            .find(|r| r.starts_with("impl: "))
            .unwrap()
            .clone();
        (p.path, line)
    };
    type Row<'a> = (&'a [usize], usize, Fuse, Phase, DType, &'a Config, AutoCase);
    let rows: [Row; 8] = [
        (
            &[64, 56, 56, 256],
            3,
            Fuse::Relu,
            Phase::Inference,
            DType::F16,
            &cfg,
            AutoCase::Inference,
        ),
        (
            &[65536, 256],
            1,
            Fuse::Relu,
            Phase::Training,
            DType::F32,
            &cfg,
            AutoCase::TwoD,
        ),
        (
            &[16, 32, 112, 112],
            1,
            Fuse::Relu,
            Phase::Training,
            DType::F32,
            &cfg,
            AutoCase::ChannelsFirst,
        ),
        (
            &[64, 512, 2, 2],
            1,
            Fuse::Relu,
            Phase::Training,
            DType::F16,
            &cfg,
            AutoCase::ChannelsFirstShortRuns,
        ),
        (
            &[8, 56, 56, 64],
            3,
            Fuse::Relu,
            Phase::Training,
            DType::F16,
            &cfg,
            AutoCase::ChannelsLastOnChip,
        ),
        (
            &[64, 112, 112, 64],
            3,
            Fuse::Relu,
            Phase::Training,
            DType::F16,
            &cfg,
            AutoCase::ChannelsLastFused,
        ),
        (
            &[64, 56, 56, 30],
            3,
            Fuse::AddRelu,
            Phase::Training,
            DType::F16,
            &cfg,
            AutoCase::ChannelsLastUnfused,
        ),
        (
            &[64, 112, 112, 64],
            3,
            Fuse::None,
            Phase::Training,
            DType::F16,
            &cfg,
            AutoCase::ChannelsLastPlain,
        ),
    ];
    for (shape, axis, fuse, phase, dtype, cfg, case) in rows {
        let (path, line) = case_of(shape, axis, fuse, phase, dtype, cfg);
        assert!(
            line.contains(&format!("case {}:", case.name())),
            "{shape:?}: {line}"
        );
        assert_eq!(path == BnPath::Own, case.prefers_own(), "{shape:?}: {line}");
        assert!(line.contains("docs/PERFORMANCE.md"), "{line}");
    }
    // Every row's reason cites the measurements.
    for case in AutoCase::ALL {
        assert!(case.evidence().contains("docs/PERFORMANCE.md"), "{case:?}");
    }
}

#[test]
fn forced_variants() {
    let cfg = Config::default().with_bn_impl(BnImpl::Own);
    let with = |shape: &[usize], axis, choice| {
        plan(&PlanRequest {
            shape,
            axis,
            dtype: DType::F32,
            fuse: Fuse::Relu,
            phase: Phase::Training,
            config: &cfg,
            cudnn_version: 91900,
            cudnn_available: true,
            own_variant: choice,
        })
        .unwrap()
    };
    // 64x64x112x112 f32 is far over the budget: auto is two-pass; forced persistent is planned
    // (the device decides at run time), forced two-pass is two-pass.
    let big: &[usize] = &[64, 64, 112, 112];
    let p = with(big, 1, OwnVariantChoice::Auto);
    assert_eq!(p.own_forward, Some(OwnVariant::TwoPass));
    let p = with(big, 1, OwnVariantChoice::Persistent);
    assert_eq!(
        (p.own_forward, p.own_backward),
        (Some(OwnVariant::Persistent), Some(OwnVariant::Persistent))
    );
    assert!(p.reasons.iter().any(|r| r.contains("as asked")));
    let small: &[usize] = &[2, 8, 32, 32];
    let p = with(small, 1, OwnVariantChoice::TwoPass);
    assert_eq!(
        (p.own_forward, p.own_backward),
        (Some(OwnVariant::TwoPass), Some(OwnVariant::TwoPass))
    );
    // Persistent asked for a shape whose structure refuses it: two-pass, with the reason.
    let p = with(&[2, 8, 7, 7], 1, OwnVariantChoice::Persistent);
    assert_eq!(p.own_forward, Some(OwnVariant::TwoPass));
    assert!(p
        .reasons
        .iter()
        .any(|r| r.contains("although persistent was asked for")));
    // Few values per channel: the backward runs per channel in f64 whatever was asked for;
    // the forward follows the choice.
    for choice in [
        OwnVariantChoice::Auto,
        OwnVariantChoice::TwoPass,
        OwnVariantChoice::Persistent,
    ] {
        for (shape, axis) in [
            (&[2usize, 64][..], 1usize),
            (&[1, 8, 2], 1),
            (&[4, 16, 4, 4], 1),
        ] {
            let p = with(shape, axis, choice);
            assert_eq!(p.own_backward, Some(OwnVariant::PerChannel), "{p}");
            assert!(
                p.reasons
                    .iter()
                    .any(|r| r.starts_with("own backward: per-channel f64")
                        && r.contains("OWN_PER_CHANNEL_MAX_M")),
                "{p}"
            );
        }
    }
    let p = with(&[65, 16], 1, OwnVariantChoice::Auto);
    assert_ne!(p.own_backward, Some(OwnVariant::PerChannel), "{p}");
    assert_eq!(
        "two-pass".parse::<OwnVariantChoice>().unwrap(),
        OwnVariantChoice::TwoPass
    );
    assert_eq!(
        "Persistent".parse::<OwnVariantChoice>().unwrap(),
        OwnVariantChoice::Persistent
    );
    assert_eq!(
        "fast".parse::<OwnVariantChoice>().unwrap_err().argument(),
        Some("own_variant")
    );
}

// ---- properties ----

fn policy_strategy() -> impl Strategy<Value = BnModePolicy> {
    prop_oneof![
        Just(BnModePolicy::OneFlow),
        Just(BnModePolicy::Auto),
        Just(BnModePolicy::Fast)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn plan_invariants(
        shape in prop::collection::vec(prop_oneof![Just(1usize), 1usize..12], 1..7),
        axis_seed in 0usize..64,
        policy in policy_strategy(),
        nhwc in any::<bool>(),
        disabled in any::<bool>(),
        fuse in prop::sample::select(Fuse::ALL.to_vec()),
        phase in prop::sample::select(Phase::ALL.to_vec()),
        dtype in prop::sample::select(DType::ALL.to_vec()),
        version in prop_oneof![Just(7400usize), Just(7401usize), 6000usize..100_000],
    ) {
        let axis = axis_seed % shape.len();
        let cfg = config(policy, nhwc, disabled);
        let p = make(&shape, axis, dtype, fuse, phase, &cfg, version);
        let persistent = p.mode == SpatialPersistent;
        let training = p.phase == Phase::Training;

        if p.path != BnPath::Own {
            prop_assert_eq!(p.path == BnPath::CudnnFused, p.refusals.is_empty());
        }
        if policy == BnModePolicy::OneFlow {
            prop_assert!(p.path != BnPath::Own, "oneflow keeps cuDNN");
        }
        prop_assert_eq!(p.own_forward.is_some(), p.path == BnPath::Own);
        if p.path == BnPath::CudnnFused {
            prop_assert!(p.layout.format == Nhwc && persistent && training && fuse != Fuse::None);
            prop_assert!(version >= 7401);
            prop_assert!(fuse != Fuse::AddRelu || p.layout.c % 4 == 0);
            prop_assert!(!disabled);
        }
        prop_assert_eq!(p.path == BnPath::Plain, fuse == Fuse::None && p.path != BnPath::Own);
        if policy == BnModePolicy::OneFlow {
            // OneFlow's rule, except where PER_ACTIVATION would not be BatchNorm (h > 1).
            let rule = oneflow_mode(shape.len(), nhwc);
            if rule == PerActivation && p.layout.h > 1 {
                prop_assert_eq!(p.mode, oneflow_mode(3, nhwc));
            } else {
                prop_assert_eq!(p.mode, rule);
            }
        }
        if policy == BnModePolicy::Fast {
            prop_assert_eq!(p.mode, SpatialPersistent);
        }
        if policy != BnModePolicy::OneFlow {
            prop_assert_ne!(p.mode, PerActivation);
        }
        if training && persistent && version >= 7401 {
            prop_assert_eq!(p.api, BnApi::Ex);
        } else {
            prop_assert_eq!(p.api, BnApi::Legacy);
        }
        let departures = p.reasons.iter().filter(|r| r.contains(DEPARTS_FROM_ONEFLOW)).count();
        prop_assert_eq!(departures, (p.mode != oneflow_mode(shape.len(), nhwc)) as usize);
        // Refusal codes are unique and in the documented order.
        let order = ["no_activation", "inference", "disabled_by_config", "not_nhwc", "not_persistent",
                     "channels_not_multiple_of_4", "dtype_unsupported", "cudnn_too_old",
                     "cudnn_missing"];
        let idx: Vec<usize> = p.refusals.iter()
            .map(|r| order.iter().position(|c| *c == r.code()).unwrap_or(usize::MAX)).collect();
        prop_assert!(idx.windows(2).all(|w| w[0] < w[1]), "{:?}", p.refusals);
        prop_assert_eq!(p.layout.numel(), shape.iter().product::<usize>());
    }
}

// ---------------------------------------------------------------------------------------------
// The cuDNN API (NNFUSE_CUDNN_API) for BatchNorm: graph or legacy, and why.

fn api_plan(
    shape: &[usize],
    axis: usize,
    dtype: DType,
    fuse: Fuse,
    phase: Phase,
    api: CudnnApi,
    bn_impl: BnImpl,
) -> BnPlan {
    let cfg = Config::default().with_cudnn_api(api).with_bn_impl(bn_impl);
    make(shape, axis, dtype, fuse, phase, &cfg, 91900)
}

fn api_line(p: &BnPlan) -> &str {
    p.reasons
        .iter()
        .find(|r| r.starts_with("cuDNN API: "))
        .map(String::as_str)
        .unwrap_or_else(|| panic!("no cuDNN API line: {p}"))
}

#[test]
fn forced_graph_runs_cudnn_training_through_the_graph() {
    let nhwc: &[usize] = &[16, 56, 56, 64];
    for dtype in [DType::F16, DType::BF16, DType::F32] {
        for fuse in Fuse::ALL {
            let p = api_plan(
                nhwc,
                3,
                dtype,
                fuse,
                Phase::Training,
                CudnnApi::Graph,
                BnImpl::Cudnn,
            );
            assert!(p.cudnn_graph, "{p}");
            assert_eq!(p.cudnn_api, CudnnApi::Graph);
            assert_eq!(p.cudnn_api_used(), Some("graph"), "{p}");
            assert!(
                api_line(&p).starts_with("cuDNN API: graph (graph) — forced"),
                "{p}"
            );
            // The legacy entry point stays planned: it runs if cuDNN cannot build the graph.
            assert_eq!(p.api, BnApi::Ex, "{p}");
            let j = p.to_json();
            assert_eq!(j["cudnn_api"], "graph");
            assert_eq!(j["cudnn_api_used"], "graph");
            assert!(
                p.to_string()
                    .contains("  cuDNN  : graph API (NNFUSE_CUDNN_API graph)"),
                "{p}"
            );
            let epilogue = p.reasons.iter().find(|r| r.starts_with("epilogue: "));
            match fuse {
                Fuse::None => {
                    assert_eq!(p.path, BnPath::Plain, "{p}");
                    assert!(epilogue.is_none(), "{p}");
                }
                // The activation inside the graph (cuDNN's fused path, through the graph):
                // the legacy Ex call's refusals do not apply, the epilogue line says what
                // runs and what follows if cuDNN cannot build it.
                _ => {
                    assert_eq!(p.path, BnPath::CudnnFused, "{p}");
                    assert!(p.refusals.is_empty(), "{p}");
                    assert!(!p.refusals.contains(&FusedRefusal::GraphApi), "{p}");
                    let e = epilogue.unwrap_or_else(|| panic!("no epilogue line: {p}"));
                    assert!(e.starts_with("epilogue: graph — NORM_FORWARD → "), "{e}");
                    // The backward reads cuDNN's BOOLEAN mask (RELU_BWD from y lists 0
                    // engine configs on cuDNN 9.19, measured).
                    assert!(e.contains("dy · mask → NORM_BACKWARD"), "{e}");
                    assert!(e.contains("bitmask kernels (the fallback path)"), "{e}");
                    assert_eq!(e.contains("ADD (addend)"), fuse == Fuse::AddRelu, "{e}");
                }
            }
        }
    }
    // Forced graph is tried on channels-first input too (falls back at run time if cuDNN has
    // no engine for it).
    let p = api_plan(
        &[8, 32, 28, 28],
        1,
        DType::F32,
        Fuse::None,
        Phase::Training,
        CudnnApi::Graph,
        BnImpl::Cudnn,
    );
    assert!(p.cudnn_graph, "{p}");
}

/// Inference through the graph (NORM_FORWARD, phase INFERENCE, after nnfuse's inv_std kernel),
/// with the activation in the graph; the path keeps saying that the legacy fused call does not
/// exist for inference (what runs if cuDNN cannot build the graph).
#[test]
fn forced_graph_runs_inference_through_the_graph() {
    for dtype in [DType::F16, DType::BF16, DType::F32] {
        for fuse in Fuse::ALL {
            let p = api_plan(
                &[16, 56, 56, 64],
                3,
                dtype,
                fuse,
                Phase::Inference,
                CudnnApi::Graph,
                BnImpl::Cudnn,
            );
            assert!(p.cudnn_graph, "{p}");
            assert_eq!(p.cudnn_api_used(), Some("graph"), "{p}");
            let api = api_line(&p);
            assert!(api.starts_with("cuDNN API: graph (graph) — forced"), "{p}");
            assert!(api.contains("NORM_FORWARD (inference"), "{api}");
            assert!(api.contains("inv_std kernel"), "{api}");
            let epilogue = p.reasons.iter().find(|r| r.starts_with("epilogue: "));
            if fuse == Fuse::None {
                assert_eq!(p.path, BnPath::Plain, "{p}");
                assert!(epilogue.is_none(), "{p}");
            } else {
                assert_eq!(p.path, BnPath::Fallback, "{p}");
                assert!(p.refusals.contains(&FusedRefusal::Inference), "{p}");
                let e = epilogue.unwrap_or_else(|| panic!("no epilogue line: {p}"));
                assert!(
                    e.starts_with("epilogue: graph — NORM_FORWARD (inference) → "),
                    "{e}"
                );
                assert!(e.contains("activation kernel"), "{e}");
            }
        }
    }
}

/// NNFUSE_DISABLE_CUDNN_FUSION keeps the activation out of the graph too: graph BatchNorm, then
/// the bitmask kernels (the fallback path, refused by the config).
#[test]
fn disabled_fusion_keeps_the_epilogue_out_of_the_graph() {
    for phase in [Phase::Training, Phase::Inference] {
        let cfg = Config::default()
            .with_cudnn_api(CudnnApi::Graph)
            .with_bn_impl(BnImpl::Cudnn)
            .with_cudnn_fusion_disabled(true);
        let p = make(
            &[16, 56, 56, 64],
            3,
            DType::F16,
            Fuse::Relu,
            phase,
            &cfg,
            91900,
        );
        assert!(p.cudnn_graph, "{p}");
        assert_eq!(p.path, BnPath::Fallback, "{p}");
        assert!(p.refusals.contains(&FusedRefusal::DisabledByConfig), "{p}");
        assert!(
            !p.reasons.iter().any(|r| r.starts_with("epilogue: ")),
            "{p}"
        );
    }
}

#[test]
fn graph_is_refused_with_a_reason_where_it_cannot_apply() {
    // PER_ACTIVATION (the oneflow policy's 2-D mode) has no graph form.
    let cfg = Config::default()
        .with_cudnn_api(CudnnApi::Graph)
        .with_bn_mode_policy(BnModePolicy::OneFlow);
    let p = make(
        &[256, 1024],
        1,
        DType::F16,
        Fuse::None,
        Phase::Training,
        &cfg,
        91900,
    );
    assert_eq!(p.mode, PerActivation, "{p}");
    assert!(
        !p.cudnn_graph && api_line(&p).contains("PER_ACTIVATION"),
        "{p}"
    );
    // cuDNN 8 has no libcudnn_graph route here.
    let cfg = Config::default().with_cudnn_api(CudnnApi::Graph);
    let p = make(
        &[16, 56, 56, 64],
        3,
        DType::F16,
        Fuse::None,
        Phase::Training,
        &cfg,
        8907,
    );
    assert!(!p.cudnn_graph && api_line(&p).contains("predates"), "{p}");
    // Legacy keeps today's plan bit for bit (but for the API line itself).
    for api in [CudnnApi::Legacy, CudnnApi::Auto] {
        let p = api_plan(
            &[16, 56, 56, 64],
            3,
            DType::F16,
            Fuse::AddRelu,
            Phase::Training,
            api,
            BnImpl::Cudnn,
        );
        if api == CudnnApi::Legacy || !GRAPH_FOR_AUTO {
            assert!(!p.cudnn_graph, "{p}");
            assert_eq!((p.api, p.path), (BnApi::Ex, BnPath::CudnnFused), "{p}");
            assert!(p.refusals.is_empty(), "{p}");
            assert_eq!(p.to_json()["cudnn_api_used"], "legacy");
        }
    }
    // Without cuDNN: no API; on the own path: cuDNN does not run.
    let cfg = Config::default().with_cudnn_api(CudnnApi::Graph);
    let p = make_with(
        &[16, 56, 56, 64],
        3,
        DType::F16,
        Fuse::Relu,
        Phase::Training,
        &cfg,
        91900,
        false,
    );
    assert!(!p.cudnn_graph && p.cudnn_api_used().is_none(), "{p}");
    assert!(p.to_string().contains("  cuDNN  : no API"), "{p}");
    let p = api_plan(
        &[16, 56, 56, 64],
        3,
        DType::F16,
        Fuse::Relu,
        Phase::Training,
        CudnnApi::Graph,
        BnImpl::Own,
    );
    assert_eq!(p.path, BnPath::Own, "{p}");
    assert!(p.cudnn_api_used().is_none(), "{p}");
    assert!(p.to_json()["cudnn_api_used"].is_null());
    assert!(!p.refusals.contains(&FusedRefusal::GraphApi), "{p}");
}

#[test]
fn auto_takes_the_graph_only_when_switched_on_and_documented() {
    for (shape, axis, dtype) in [
        (&[16usize, 56, 56, 64][..], 3, DType::F16),
        (&[16, 56, 56, 64], 3, DType::F32),
        (&[16, 64, 56, 56], 1, DType::BF16),
    ] {
        let p = api_plan(
            shape,
            axis,
            dtype,
            Fuse::None,
            Phase::Training,
            CudnnApi::Auto,
            BnImpl::Cudnn,
        );
        let want = GRAPH_FOR_AUTO && graph_supported(&p.layout, dtype).is_ok();
        assert_eq!(p.cudnn_graph, want, "{p}");
        assert!(
            api_line(&p).starts_with(if want {
                "cuDNN API: graph (auto)"
            } else {
                "cuDNN API: legacy (auto)"
            }),
            "{p}"
        );
    }
}
