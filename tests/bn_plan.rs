//! The BatchNorm plan on the CPU: the whole grid of policies, shapes, fusions, phases, data
//! types, NHWC flag, fusion switch and cuDNN versions, spot checks with literal expectations,
//! and properties over random shapes and configurations.

use nnfuse::batchnorm::{
    fused_dtype_supported, oneflow_mode, plan, BnApi, BnMode, BnPath, BnPlan, Fuse, FusedRefusal,
    Phase, PlanRequest, DEPARTS_FROM_ONEFLOW,
};
use nnfuse::{BnModePolicy, Config, DType, TensorFormat};
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

const CASES: &[Case] = &[
    Case {
        what: "2-D (N, C)",
        shape: &[256, 1024],
        axis: 1,
        layout: (256, 1024, 1, 1, Nhwc),
    },
    Case {
        what: "2-D, C = 30",
        shape: &[64, 30],
        axis: 1,
        layout: (64, 30, 1, 1, Nhwc),
    },
    Case {
        what: "2-D, axis 0, (C, M)",
        shape: &[30, 7],
        axis: 0,
        layout: (1, 30, 7, 1, Nchw),
    },
    Case {
        what: "2-D, axis 0, (C, 1)",
        shape: &[32, 1],
        axis: 0,
        layout: (1, 32, 1, 1, Nhwc),
    },
    Case {
        what: "1-D",
        shape: &[32],
        axis: 0,
        layout: (1, 32, 1, 1, Nhwc),
    },
    Case {
        what: "3-D channels-first",
        shape: &[8, 32, 100],
        axis: 1,
        layout: (8, 32, 100, 1, Nchw),
    },
    Case {
        what: "3-D channels-last",
        shape: &[8, 100, 32],
        axis: 2,
        layout: (8, 32, 100, 1, Nhwc),
    },
    Case {
        what: "4-D channels-first",
        shape: &[16, 32, 112, 112],
        axis: 1,
        layout: (16, 32, 12544, 1, Nchw),
    },
    Case {
        what: "4-D channels-last",
        shape: &[64, 56, 56, 256],
        axis: 3,
        layout: (64, 256, 3136, 1, Nhwc),
    },
    Case {
        what: "4-D channels-first, C = 30",
        shape: &[16, 30, 56, 56],
        axis: 1,
        layout: (16, 30, 3136, 1, Nchw),
    },
    Case {
        what: "4-D channels-last, C = 30",
        shape: &[16, 56, 56, 30],
        axis: 3,
        layout: (16, 30, 3136, 1, Nhwc),
    },
    Case {
        what: "5-D channels-first",
        shape: &[2, 16, 4, 8, 8],
        axis: 1,
        layout: (2, 16, 256, 1, Nchw),
    },
    Case {
        what: "5-D channels-last",
        shape: &[2, 4, 8, 8, 16],
        axis: 4,
        layout: (2, 16, 256, 1, Nhwc),
    },
    Case {
        what: "axis 0",
        shape: &[32, 4, 4],
        axis: 0,
        layout: (1, 32, 16, 1, Nchw),
    },
    Case {
        what: "axis 0, trailing ones",
        shape: &[32, 1, 1],
        axis: 0,
        layout: (1, 32, 1, 1, Nhwc),
    },
    Case {
        what: "axis in the middle",
        shape: &[4, 6, 32, 5],
        axis: 2,
        layout: (24, 32, 5, 1, Nchw),
    },
    Case {
        what: "axis in the middle, inner 1",
        shape: &[4, 6, 32, 1],
        axis: 2,
        layout: (4, 32, 6, 1, Nhwc),
    },
    Case {
        what: "N = 1 channels-first",
        shape: &[1, 32, 56, 56],
        axis: 1,
        layout: (1, 32, 3136, 1, Nchw),
    },
    Case {
        what: "N = 1 channels-last",
        shape: &[1, 56, 56, 32],
        axis: 3,
        layout: (1, 32, 3136, 1, Nhwc),
    },
    Case {
        what: "H = W = 1 (N, C, 1, 1) infers NHWC",
        shape: &[64, 32, 1, 1],
        axis: 1,
        layout: (64, 32, 1, 1, Nhwc),
    },
    Case {
        what: "H = W = 1, C = 30",
        shape: &[64, 30, 1, 1],
        axis: 1,
        layout: (64, 30, 1, 1, Nhwc),
    },
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
    plan(&PlanRequest {
        shape,
        axis,
        dtype,
        fuse,
        phase,
        config,
        cudnn_version,
    })
    .unwrap_or_else(|e| panic!("plan({shape:?}, axis {axis}) failed: {e}"))
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

#[test]
fn the_whole_grid() {
    let mut plans = 0usize;
    let mut fused = 0usize;
    for case in CASES {
        for policy in POLICIES {
            for nhwc in [false, true] {
                for disabled in [false, true] {
                    for fuse in Fuse::ALL {
                        for phase in Phase::ALL {
                            for dtype in DType::ALL {
                                for version in VERSIONS {
                                    let cfg = config(policy, nhwc, disabled);
                                    let p = make(
                                        case.shape, case.axis, dtype, fuse, phase, &cfg, version,
                                    );
                                    let ctx = format!(
                                        "{} {:?} axis {}: {policy} nhwc={nhwc} disabled={disabled} \
                                         {fuse} {phase} {dtype} cuDNN {version}\n{p}",
                                        case.what, case.shape, case.axis
                                    );
                                    check_one(
                                        case, policy, nhwc, disabled, fuse, phase, dtype, version,
                                        &p, &ctx,
                                    );
                                    plans += 1;
                                    fused += (p.path == BnPath::CudnnFused) as usize;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    assert_eq!(plans, CASES.len() * 3 * 2 * 2 * 3 * 2 * 3 * 3);
    assert!(fused > 0, "the grid must reach the fused path");
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
        if version < 7401 {
            refusals.push(FusedRefusal::CudnnTooOld(version));
        }
    }
    assert_eq!(p.refusals, refusals, "refusals: {ctx}");

    // Path.
    let path = match (fuse, refusals.is_empty()) {
        (Fuse::None, _) => BnPath::Plain,
        (_, true) => BnPath::CudnnFused,
        (_, false) => BnPath::Fallback,
    };
    assert_eq!(p.path, path, "path: {ctx}");

    // API: Ex exactly for persistent training on a cuDNN that has it.
    let api = if phase == Phase::Training && mode == SpatialPersistent && version >= 7401 {
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
    for r in &p.refusals {
        let line = format!("not fused: {r}");
        assert_eq!(
            p.reasons.iter().filter(|x| **x == line).count(),
            1,
            "refusal line {r:?}: {ctx}"
        );
    }
    let expected_len = 4 + departures + p.refusals.len();
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
}

// ---- spot checks with literal expectations ----

fn spot(shape: &[usize], axis: usize, fuse: Fuse, phase: Phase, cfg: &Config) -> BnPlan {
    make(shape, axis, DType::F16, fuse, phase, cfg, 91900)
}

#[test]
fn channels_last_add_relu_is_fused() {
    let p = spot(
        &[64, 56, 56, 256],
        3,
        Fuse::AddRelu,
        Phase::Training,
        &Config::default(),
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
fn channels_first_default_falls_back_with_two_refusals() {
    let p = spot(
        &[16, 32, 112, 112],
        1,
        Fuse::AddRelu,
        Phase::Training,
        &Config::default(),
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
    let cfg = Config::default().with_cudnn_fusion_disabled(true);
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
    let cfg = Config::default();
    let relu = spot(&[16, 56, 56, 30], 3, Fuse::Relu, Phase::Training, &cfg);
    assert_eq!(relu.path, BnPath::CudnnFused);
    let add = spot(&[16, 56, 56, 30], 3, Fuse::AddRelu, Phase::Training, &cfg);
    assert_eq!(add.path, BnPath::Fallback);
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
    let p = spot(
        &[64, 32, 1, 1],
        1,
        Fuse::AddRelu,
        Phase::Training,
        &Config::default(),
    );
    assert_eq!(p.layout.format, Nhwc);
    assert_eq!(
        (p.mode, p.api, p.path),
        (SpatialPersistent, BnApi::Ex, BnPath::CudnnFused)
    );
}

#[test]
fn channels_last_inference_follows_the_flag_under_auto() {
    let off = spot(
        &[64, 56, 56, 256],
        3,
        Fuse::Relu,
        Phase::Inference,
        &Config::default(),
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
        &Config::default().with_nhwc(true),
    );
    assert_eq!((on.mode, on.api), (SpatialPersistent, BnApi::Legacy));
    assert_eq!(on.refusals, vec![FusedRefusal::Inference]);
}

#[test]
fn nhwc_flag_and_fast_policy_on_channels_first() {
    let flag = spot(
        &[16, 32, 112, 112],
        1,
        Fuse::None,
        Phase::Training,
        &Config::default().with_nhwc(true),
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
    let cfg = Config::default();
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
    let cfg = Config::default().with_cudnn_fusion_disabled(true);
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
            &Config::default(),
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
        })
        .unwrap_err()
    };
    assert_eq!(try_plan(&[], 0).argument(), Some("shape"));
    assert_eq!(try_plan(&[2, 3], 2).argument(), Some("axis"));
    assert_eq!(try_plan(&[2, 0, 3], 1).argument(), Some("shape[1]"));
    assert_eq!(try_plan(&[1 << 16, 1 << 16], 1).argument(), Some("shape"));
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

        prop_assert_eq!(p.path == BnPath::CudnnFused, p.refusals.is_empty());
        if p.path == BnPath::CudnnFused {
            prop_assert!(p.layout.format == Nhwc && persistent && training && fuse != Fuse::None);
            prop_assert!(version >= 7401);
            prop_assert!(fuse != Fuse::AddRelu || p.layout.c % 4 == 0);
            prop_assert!(!disabled);
        }
        prop_assert_eq!(p.path == BnPath::Plain, fuse == Fuse::None);
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
                     "channels_not_multiple_of_4", "dtype_unsupported", "cudnn_too_old"];
        let idx: Vec<usize> = p.refusals.iter()
            .map(|r| order.iter().position(|c| *c == r.code()).unwrap_or(usize::MAX)).collect();
        prop_assert!(idx.windows(2).all(|w| w[0] < w[1]), "{:?}", p.refusals);
        prop_assert_eq!(p.layout.numel(), shape.iter().product::<usize>());
    }
}
