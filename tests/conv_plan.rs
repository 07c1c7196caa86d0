//! The convolution plan on the CPU: every reason reachable, every policy and direction, with and
//! without cuDNN, over a grid of problems; invariants that hold for every plan; the seed's
//! tensor-core rule as the plan shows it. No GPU.

use nnfuse::config::{Config, ConvAlgoPolicy, WinogradGemmPolicy};
use nnfuse::conv::{
    plan, ConvPath, ConvPlan, ConvPlanRequest, ConvShape, Direction, EngineDecision,
    WinogradEngine, WinogradTile,
};
use nnfuse::internals::conv::DIRECT_CANDIDATE_MAX_FLOPS;
use nnfuse::{DType, TensorFormat};

fn shape(n: usize, c: usize, h: usize, k: usize, r: usize, fmt: TensorFormat) -> ConvShape {
    ConvShape {
        n,
        c_in: c,
        h,
        w: h,
        c_out: k,
        kh: r,
        kw: r,
        stride: (1, 1),
        pad: (r / 2, r / 2),
        dilation: (1, 1),
        format: fmt,
    }
}

fn plan_of(
    s: ConvShape,
    dtype: DType,
    direction: Direction,
    config: &Config,
    cudnn_present: bool,
) -> ConvPlan {
    plan(&ConvPlanRequest {
        shape: s,
        dtype,
        direction,
        config,
        cudnn_present,
        // cuDNN 9 (the graph API) wherever cuDNN is present; plan_with_graph varies it.
        cudnn_graph: cudnn_present,
    })
    .unwrap_or_else(|e| panic!("{s:?} {direction}: {e}"))
}

fn has_reason(p: &ConvPlan, needle: &str) -> bool {
    p.reasons.iter().any(|r| r.contains(needle))
}

fn why(p: &ConvPlan, path: ConvPath) -> String {
    p.info(path).why_not.clone().unwrap_or_default()
}

const NHWC: TensorFormat = TensorFormat::Nhwc;
const NCHW: TensorFormat = TensorFormat::Nchw;

#[test]
fn resnet_3x3_f16_nhwc_auto_measures_everything_eligible() {
    let s = shape(32, 64, 56, 64, 3, NHWC);
    let p = plan_of(s, DType::F16, Direction::Forward, &Config::default(), true);
    assert!(p.runnable && p.measured && p.fallback.is_none());
    assert_eq!(p.path, ConvPath::Cudnn, "cuDNN is the incumbent");
    let labels: Vec<String> = p.candidates.iter().map(|r| r.label()).collect();
    assert_eq!(
        labels,
        [
            "cudnn",
            "im2col_gemm",
            "winograd_f4x3/tensor_core",
            "winograd_f4x3/direct",
            "winograd_f4x3/fused",
            "winograd_f2x3/tensor_core",
            "winograd_f2x3/direct",
            "winograd_f2x3/fused",
        ],
        "the direct kernel is not measured at {:.1} GFLOP",
        p.flops / 1e9
    );
    assert!(p.flops > DIRECT_CANDIDATE_MAX_FLOPS);
    assert!(p.eligible(ConvPath::Direct));
    assert!(has_reason(&p, "not measured by auto"));
    // F(4x4): 14x14 tiles per image, all 32 images in one chunk: 6272 tiles, (16,16,16).
    let w = p.info(ConvPath::WinogradF4x3).winograd.clone().unwrap();
    assert_eq!((w.tiles, w.c_in, w.c_out), (32 * 196, 64, 64));
    assert_eq!(w.seed_rule, Some((16, 16, 16)));
    assert_eq!(w.decided_by, EngineDecision::Measured);
    assert_eq!(
        w.engines,
        [
            WinogradEngine::TensorCore,
            WinogradEngine::Direct,
            WinogradEngine::Fused
        ]
    );
    assert_eq!(w.fused_why_not, None);
    assert!(has_reason(&p, "the fused engine can run it"));
    // Scratch of F(4x4): transformed filter + 32 images' transformed input and product.
    let want = 2 * (36 * 64 * 64 + 32 * 36 * 196 * (64 + 64));
    assert_eq!(p.info(ConvPath::WinogradF4x3).scratch_bytes, want);
    let json = p.to_json();
    assert_eq!(json["path"], "cudnn");
    assert_eq!(json["candidates"].as_array().unwrap().len(), 8);
    assert_eq!(json["paths"][3]["winograd"]["seed_rule"][0], 16);
    assert_eq!(json["paths"][3]["winograd"]["engines"][2], "fused");
    assert!(json["paths"][3]["winograd"]["fused_why_not"].is_null());
    let text = p.to_string();
    assert!(
        text.contains("measured at the first call among 8 candidates"),
        "{text}"
    );
    // f32 and channel counts not multiples of 8: no fused candidate, and the plan says why.
    let p = plan_of(s, DType::F32, Direction::Forward, &Config::default(), true);
    let w = p.info(ConvPath::WinogradF4x3).winograd.clone().unwrap();
    assert_eq!(
        w.engines,
        [WinogradEngine::TensorCore, WinogradEngine::Direct]
    );
    assert!(w.fused_why_not.unwrap().contains("f16 and bf16"));
    assert!(has_reason(&p, "the fused engine cannot"));
    let p = plan_of(
        shape(32, 30, 56, 64, 3, NHWC),
        DType::BF16,
        Direction::Forward,
        &Config::default(),
        true,
    );
    let w = p.info(ConvPath::WinogradF2x3).winograd.clone().unwrap();
    assert!(!w.engines.contains(&WinogradEngine::Fused));
    assert!(w.fused_why_not.unwrap().contains("c_in = 30"));
}

#[test]
fn fused_policy_forces_the_fused_engine_where_it_runs() {
    let cfg = Config::default().with_winograd_gemm(WinogradGemmPolicy::Fused);
    let s = shape(32, 128, 28, 128, 3, NHWC);
    for direction in [Direction::Forward, Direction::BackwardData] {
        let p = plan_of(s, DType::BF16, direction, &cfg, true);
        for path in [ConvPath::WinogradF2x3, ConvPath::WinogradF4x3] {
            let w = p.info(path).winograd.clone().unwrap();
            assert_eq!(
                (w.engines, w.decided_by),
                (vec![WinogradEngine::Fused], EngineDecision::Forced)
            );
        }
        let labels: Vec<String> = p.candidates.iter().map(|r| r.label()).collect();
        assert!(
            labels.contains(&"winograd_f4x3/fused".to_string()),
            "{labels:?}"
        );
    }
    // Where it cannot run, the seed's rule decides, and the plan says why.
    let p = plan_of(s, DType::F32, Direction::Forward, &cfg, true);
    let w = p.info(ConvPath::WinogradF4x3).winograd.clone().unwrap();
    assert_eq!(w.engines, [w.seed_engine]);
    assert_eq!(w.decided_by, EngineDecision::SeedRule);
    assert!(has_reason(
        &p,
        "winograd_gemm fused: the fused engine cannot"
    ));
    let text = p.to_string();
    assert!(text.contains("winograd_gemm fused"), "{text}");
}

#[test]
fn seed_rule_decides_the_engine_under_seed() {
    let cfg = Config::default().with_winograd_gemm(WinogradGemmPolicy::Seed);
    // C = 30 is divisible by no 16: Direct for both tiles.
    let s = shape(3, 30, 14, 64, 3, NHWC);
    let p = plan_of(s, DType::F16, Direction::Forward, &cfg, true);
    for path in [ConvPath::WinogradF2x3, ConvPath::WinogradF4x3] {
        let w = p.info(path).winograd.clone().unwrap();
        assert_eq!(w.seed_rule, None);
        assert_eq!(w.engines, [WinogradEngine::Direct]);
        assert_eq!(w.decided_by, EngineDecision::SeedRule);
    }
    assert!(has_reason(&p, "divisible by none of"));
    // 8 tiles, C_in 16, C_out 32: the (8, 16, 32) triple. F(4x4) on 8x8 output: 2x2 tiles per
    // image, two images.
    let s = shape(2, 16, 8, 32, 3, NHWC);
    let p = plan_of(s, DType::F16, Direction::Forward, &cfg, true);
    let w = p.info(ConvPath::WinogradF4x3).winograd.clone().unwrap();
    assert_eq!((w.tiles, w.seed_rule), (8, Some((8, 16, 32))));
    assert_eq!(w.engines, [WinogradEngine::TensorCore]);
    // Forced engines say what the rule would have said.
    for (pol, e) in [
        (WinogradGemmPolicy::TensorCore, WinogradEngine::TensorCore),
        (WinogradGemmPolicy::Direct, WinogradEngine::Direct),
    ] {
        let cfg = Config::default().with_winograd_gemm(pol);
        let p = plan_of(s, DType::F16, Direction::Forward, &cfg, true);
        let w = p.info(ConvPath::WinogradF4x3).winograd.clone().unwrap();
        assert_eq!(
            (w.engines.clone(), w.decided_by),
            (vec![e], EngineDecision::Forced)
        );
        assert!(has_reason(&p, "the seed's rule would say"));
    }
}

#[test]
fn every_ineligibility_reason_is_reachable() {
    let cfg = Config::default();
    // cuDNN absent.
    let p = plan_of(
        shape(1, 3, 5, 8, 3, NHWC),
        DType::F32,
        Direction::Forward,
        &cfg,
        false,
    );
    assert!(why(&p, ConvPath::Cudnn).contains("cannot be loaded"));
    assert!(has_reason(&p, "cuDNN is absent"));
    assert_eq!(
        p.path,
        ConvPath::Im2colGemm,
        "without cuDNN the first candidate leads"
    );
    // cuDNN's int limits.
    let mut s = shape(1, 1, 5, 1, 1, NCHW);
    s.n = 1 << 31;
    let p = plan_of(s, DType::F16, Direction::Forward, &cfg, true);
    assert!(
        why(&p, ConvPath::Cudnn).contains("int sizes"),
        "{}",
        why(&p, ConvPath::Cudnn)
    );
    // im2col: the column matrix of one image over the cap.
    let small = Config::default().with_conv_workspace_mb(1);
    let big = shape(1, 512, 56, 512, 3, NCHW);
    let p = plan_of(big, DType::F16, Direction::Forward, &small, true);
    assert!(why(&p, ConvPath::Im2colGemm).contains("exceeds the workspace cap"));
    // im2col: GEMM dimensions over int (pointwise, 50000x50000 pixels).
    let mut huge = shape(1, 1, 50_000, 1, 1, NCHW);
    huge.pad = (0, 0);
    let p = plan_of(huge, DType::F16, Direction::Forward, &cfg, true);
    assert!(why(&p, ConvPath::Im2colGemm).contains("int GEMM dimensions"));
    // Winograd: format, filter size, stride, dilation; the data gradient's padding; the filter
    // gradient; the cap.
    let mut s = shape(1, 3, 9, 8, 3, NHWC);
    s.stride = (2, 2);
    s.dilation = (1, 2);
    let p = plan_of(s, DType::F16, Direction::Forward, &cfg, true);
    let w = why(&p, ConvPath::WinogradF4x3);
    assert!(w.contains("stride") && w.contains("dilation"), "{w}");
    let mut s = shape(1, 3, 9, 8, 3, NHWC);
    s.pad = (3, 1);
    let p = plan_of(s, DType::F16, Direction::BackwardData, &cfg, true);
    assert!(why(&p, ConvPath::WinogradF4x3).contains("padding"));
    assert!(plan_of(s, DType::F16, Direction::Forward, &cfg, true).eligible(ConvPath::WinogradF4x3));
    // Winograd on NCHW, on 5x5, for the filter gradient, over the cap; the direct kernel has
    // no gradients: each refusal names its reason.
    #[rustfmt::skip]
    let refusals = [
        (shape(1, 3, 9, 8, 3, NCHW), DType::F16, Direction::Forward, &cfg, ConvPath::WinogradF4x3, "NCHW"),
        (shape(1, 3, 9, 8, 5, NHWC), DType::F16, Direction::Forward, &cfg, ConvPath::WinogradF2x3, "5x5"),
        (shape(1, 3, 9, 8, 3, NHWC), DType::F16, Direction::BackwardFilter, &cfg, ConvPath::WinogradF2x3, "filter gradient"),
        (shape(1, 512, 56, 512, 3, NHWC), DType::F32, Direction::Forward, &small, ConvPath::WinogradF4x3, "exceed the workspace cap"),
        (shape(1, 3, 9, 8, 3, NHWC), DType::F16, Direction::BackwardData, &cfg, ConvPath::Direct, "forward only"),
    ];
    for (s, dtype, d, c, path, reason) in refusals {
        let p = plan_of(s, dtype, d, c, true);
        let w = why(&p, path);
        assert!(w.contains(reason), "{path:?} {d:?}: {w}");
    }
}

#[test]
fn forced_policies_fall_back_and_say_why() {
    // Winograd on NCHW: cuDNN when present, else the direct kernel (forward) / im2col
    // (gradients).
    let s = shape(2, 8, 9, 8, 3, NCHW);
    for policy in [
        ConvAlgoPolicy::Winograd,
        ConvAlgoPolicy::WinogradF2x3,
        ConvAlgoPolicy::WinogradF4x3,
    ] {
        let cfg = Config::default().with_conv_algo(policy);
        let p = plan_of(s, DType::F16, Direction::Forward, &cfg, true);
        assert_eq!(p.path, ConvPath::Cudnn);
        let fb = p.fallback.clone().unwrap();
        assert!(
            fb.contains("falling back to cudnn") && fb.contains("NCHW"),
            "{fb}"
        );
        let p = plan_of(s, DType::F16, Direction::Forward, &cfg, false);
        assert_eq!(p.path, ConvPath::Direct);
        let p = plan_of(s, DType::F16, Direction::BackwardData, &cfg, false);
        assert_eq!(p.path, ConvPath::Im2colGemm);
    }
    // cuDNN forced but absent.
    let cfg = Config::default().with_conv_algo(ConvAlgoPolicy::Cudnn);
    let p = plan_of(s, DType::F32, Direction::Forward, &cfg, false);
    assert_eq!(p.path, ConvPath::Direct);
    assert!(p.fallback.unwrap().contains("cannot be loaded"));
    // Direct forced for a gradient.
    let cfg = Config::default().with_conv_algo(ConvAlgoPolicy::Direct);
    let p = plan_of(s, DType::F32, Direction::BackwardFilter, &cfg, true);
    assert_eq!(p.path, ConvPath::Cudnn);
    assert!(p.fallback.is_some());
    // Forced and eligible: no fallback, one path (its engines measured under winograd_gemm
    // auto).
    let cfg = Config::default().with_conv_algo(ConvAlgoPolicy::WinogradF2x3);
    let p = plan_of(
        shape(2, 8, 9, 8, 3, NHWC),
        DType::F16,
        Direction::Forward,
        &cfg,
        true,
    );
    assert!(p.fallback.is_none() && p.measured);
    assert!(p
        .candidates
        .iter()
        .all(|r| r.path == ConvPath::WinogradF2x3));
    let cfg = cfg.with_winograd_gemm(WinogradGemmPolicy::Seed);
    let p = plan_of(
        shape(2, 8, 9, 8, 3, NHWC),
        DType::F16,
        Direction::Forward,
        &cfg,
        true,
    );
    assert!(!p.measured && p.candidates.len() == 1);
    assert_eq!(
        p.engine,
        Some(WinogradEngine::Direct),
        "C = 8 fails the rule"
    );
}

#[test]
fn auto_runs_the_direct_kernel_when_nothing_else_can() {
    // No cuDNN, NCHW (no Winograd), im2col over a 1 MiB cap, large: only the direct kernel.
    let cfg = Config::default().with_conv_workspace_mb(1);
    let s = shape(8, 512, 56, 512, 3, NCHW);
    let p = plan_of(s, DType::F16, Direction::Forward, &cfg, false);
    assert!(p.flops > DIRECT_CANDIDATE_MAX_FLOPS);
    assert_eq!(p.candidates.len(), 1);
    assert_eq!(p.path, ConvPath::Direct);
    assert!(has_reason(&p, "despite its size"));
    // The same gradient has nothing at all: not runnable, and it says why.
    let p = plan_of(s, DType::F16, Direction::BackwardData, &cfg, false);
    assert!(!p.runnable);
    assert!(p.to_string().contains("NOT RUNNABLE"));
    assert!(p.fallback.unwrap().contains("neither can the fallbacks"));
    // Small problems measure the direct kernel too (and f32 the forward as a data gradient).
    let s = shape(1, 3, 7, 8, 3, NCHW);
    let p = plan_of(s, DType::F32, Direction::Forward, &Config::default(), true);
    assert_eq!(
        p.candidates.iter().map(|r| r.path).collect::<Vec<_>>(),
        [
            ConvPath::Cudnn,
            ConvPath::CudnnDual,
            ConvPath::Im2colGemm,
            ConvPath::Direct
        ]
    );
}

#[test]
fn backward_plans() {
    let cfg = Config::default();
    let s = shape(32, 128, 28, 64, 3, NHWC);
    // Data gradient: Winograd on the swapped problem (C_in' = 64 = c_out, C_out' = 128).
    let p = plan_of(s, DType::BF16, Direction::BackwardData, &cfg, true);
    let w = p.info(ConvPath::WinogradF4x3).winograd.clone().unwrap();
    assert_eq!((w.c_in, w.c_out), (64, 128));
    assert!(has_reason(&p, "rotated, channel-swapped filter"));
    assert!(has_reason(&p, "col2im"));
    assert!(has_reason(&p, "not deterministic"));
    assert!(!p.eligible(ConvPath::Direct));
    // Filter gradient: cuDNN and im2col only.
    let p = plan_of(s, DType::BF16, Direction::BackwardFilter, &cfg, true);
    assert_eq!(
        p.candidates.iter().map(|r| r.path).collect::<Vec<_>>(),
        [ConvPath::Cudnn, ConvPath::Im2colGemm]
    );
    assert!(has_reason(&p, "accumulated in f32"));
    let det = Config::default().with_deterministic(true);
    let p = plan_of(s, DType::BF16, Direction::BackwardFilter, &det, true);
    assert!(p.deterministic && has_reason(&p, "only cuDNN's deterministic algorithms"));
    // Without cuDNN the filter gradient is im2col alone: nothing to measure.
    let p = plan_of(s, DType::BF16, Direction::BackwardFilter, &cfg, false);
    assert_eq!((p.path, p.measured), (ConvPath::Im2colGemm, false));
}

/// The f32 NCHW pointwise filter gradient that im2col + GEMM computes in pieces is measured
/// first (its incumbent); other directions, dtypes, formats and forced policies keep cuDNN first.
#[test]
fn f32_nchw_pointwise_filter_gradient_in_pieces_leads() {
    let mut s = shape(32, 64, 56, 256, 1, NCHW);
    s.pad = (0, 0);
    let cfg = Config::default();
    let p = plan_of(s, DType::F32, Direction::BackwardFilter, &cfg, true);
    assert_eq!(
        p.candidates[0].path,
        ConvPath::Im2colGemm,
        "{:?}",
        p.candidates
    );
    assert_eq!(p.path, ConvPath::Im2colGemm);
    assert!(p.candidates.iter().any(|r| r.path == ConvPath::Cudnn));
    assert!(has_reason(&p, "in pieces"), "{:?}", p.reasons);
    for (dtype, format, d) in [
        (DType::F16, NCHW, Direction::BackwardFilter),
        (DType::F32, NHWC, Direction::BackwardFilter),
        (DType::F32, NCHW, Direction::Forward),
        (DType::F32, NCHW, Direction::BackwardData),
    ] {
        let q = ConvShape { format, ..s };
        let p = plan_of(q, dtype, d, &cfg, true);
        assert_eq!(
            p.candidates[0].path,
            ConvPath::Cudnn,
            "{dtype} {format:?} {d}"
        );
        assert!(!has_reason(&p, "in pieces"));
    }
    // Wide filters over few pixels take the permuted GEMM: cuDNN leads.
    let mut w = shape(32, 2048, 7, 512, 1, NCHW);
    w.pad = (0, 0);
    let p = plan_of(w, DType::F32, Direction::BackwardFilter, &cfg, true);
    assert_eq!(p.candidates[0].path, ConvPath::Cudnn);
    // A forced policy is not reordered.
    let forced = Config {
        conv_algo: nnfuse::ConvAlgoPolicy::Im2col,
        ..Config::default()
    };
    let p = plan_of(s, DType::F32, Direction::BackwardFilter, &forced, true);
    assert_eq!(p.candidates.len(), 1);
    assert!(!has_reason(&p, "in pieces"));
}

#[test]
fn pointwise_needs_no_columns() {
    let mut s = shape(64, 256, 56, 64, 1, NHWC);
    s.pad = (0, 0);
    let p = plan_of(s, DType::F16, Direction::Forward, &Config::default(), true);
    let i = p.info(ConvPath::Im2colGemm);
    assert_eq!((i.scratch_bytes, i.chunk, i.chunks), (0, Some(64), 1));
    assert!(has_reason(&p, "pointwise"));
    // Stride 2 (the downsampling 1x1) needs columns.
    s.stride = (2, 2);
    let p = plan_of(s, DType::F16, Direction::Forward, &Config::default(), true);
    assert!(p.info(ConvPath::Im2colGemm).scratch_bytes > 0);
}

#[test]
fn invalid_problems_name_the_field() {
    let cfg = Config::default();
    let base = shape(1, 3, 5, 8, 3, NHWC);
    let cases: Vec<(ConvShape, &str)> = vec![
        (ConvShape { n: 0, ..base }, "n"),
        (ConvShape { c_in: 0, ..base }, "c_in"),
        (ConvShape { h: 0, ..base }, "h"),
        (ConvShape { w: 0, ..base }, "w"),
        (ConvShape { c_out: 0, ..base }, "c_out"),
        (ConvShape { kh: 0, ..base }, "kh"),
        (ConvShape { kw: 0, ..base }, "kw"),
        (
            ConvShape {
                stride: (0, 1),
                ..base
            },
            "stride",
        ),
        (
            ConvShape {
                dilation: (1, 0),
                ..base
            },
            "dilation",
        ),
        (
            ConvShape {
                kh: 9,
                pad: (0, 1),
                ..base
            },
            "kh",
        ),
        (
            ConvShape {
                n: usize::MAX / 2,
                c_in: 1 << 20,
                ..base
            },
            "shape",
        ),
    ];
    for (s, name) in cases {
        let e = plan(&ConvPlanRequest {
            shape: s,
            dtype: DType::F32,
            direction: Direction::Forward,
            config: &cfg,
            cudnn_present: true,
            cudnn_graph: true,
        })
        .unwrap_err();
        assert_eq!(e.argument(), Some(name), "{s:?}: {e}");
    }
}

/// Every policy x engine policy x direction x cuDNN presence x dtype over a covering grid of
/// problems: the invariants every plan keeps.
#[test]
fn invariants_over_a_grid() {
    let policies = [
        ConvAlgoPolicy::Auto,
        ConvAlgoPolicy::Cudnn,
        ConvAlgoPolicy::Im2col,
        ConvAlgoPolicy::Winograd,
        ConvAlgoPolicy::WinogradF2x3,
        ConvAlgoPolicy::WinogradF4x3,
        ConvAlgoPolicy::Direct,
    ];
    let engines = [
        WinogradGemmPolicy::Auto,
        WinogradGemmPolicy::Seed,
        WinogradGemmPolicy::TensorCore,
        WinogradGemmPolicy::Direct,
        WinogradGemmPolicy::Fused,
    ];
    let mut shapes = Vec::new();
    for (i, &(n, c, h, k)) in [
        (1, 1, 1, 1),
        (3, 3, 5, 8),
        (32, 30, 7, 129),
        (1, 64, 14, 64),
        (3, 129, 31, 30),
        (1, 8, 56, 3),
        (2, 16, 9, 24),
    ]
    .iter()
    .enumerate()
    {
        for (r, stride, pad, dil) in [
            (1, (1, 1), (0, 0), (1, 1)),
            (3, (1, 1), (1, 1), (1, 1)),
            (3, (2, 2), (1, 0), (1, 1)),
            (3, (1, 1), (2, 2), (2, 2)),
            (5, (1, 1), (2, 2), (1, 1)),
            (7, (2, 2), (3, 3), (1, 1)),
            (3, (1, 1), (0, 2), (1, 1)),
        ] {
            let fmt = if (i + r) % 2 == 0 { NHWC } else { NCHW };
            let s = ConvShape {
                n,
                c_in: c,
                h,
                w: h + i % 2,
                c_out: k,
                kh: r,
                kw: r,
                stride,
                pad,
                dilation: dil,
                format: fmt,
            };
            if s.out_hw().is_ok() {
                shapes.push(s);
                shapes.push(ConvShape {
                    format: if fmt == NHWC { NCHW } else { NHWC },
                    ..s
                });
            }
        }
    }
    assert!(shapes.len() > 40);
    let mut plans = 0;
    for s in &shapes {
        for &policy in &policies {
            for (e_i, &engine) in engines.iter().enumerate() {
                let cfg = Config::default()
                    .with_conv_algo(policy)
                    .with_winograd_gemm(engine)
                    .with_deterministic(e_i % 2 == 1)
                    .with_conv_workspace_mb(if e_i == 3 { 1 } else { 256 });
                for direction in Direction::ALL {
                    for present in [true, false] {
                        let dtype = DType::ALL[(plans / 7) % 3];
                        let p = plan_of(*s, dtype, direction, &cfg, present);
                        check_invariants(&p, present);
                        plans += 1;
                    }
                }
            }
        }
    }
    assert!(plans > 5000, "{plans}");
}

fn check_invariants(p: &ConvPlan, present: bool) {
    let ctx = format!(
        "{:?} {} {} {}",
        p.shape, p.direction, p.policy, p.winograd_gemm
    );
    assert_eq!(p.paths.len(), 10, "{ctx}");
    assert!(!p.candidates.is_empty(), "{ctx}");
    assert_eq!(p.candidates[0].path, p.path, "{ctx}");
    assert_eq!(p.candidates[0].engine, p.engine, "{ctx}");
    assert_eq!(p.measured, p.candidates.len() > 1, "{ctx}");
    if p.runnable {
        for r in &p.candidates {
            assert!(p.eligible(r.path), "{ctx}: candidate {r} not eligible");
            assert_eq!(
                r.engine.is_some(),
                r.path.winograd_tile().is_some(),
                "{ctx}"
            );
            assert!(r.cudnn_algo.is_none(), "{ctx}");
        }
    } else {
        assert!(p.fallback.is_some() && !p.eligible(p.path), "{ctx}");
    }
    // Eligibility facts.
    assert_eq!(
        p.eligible(ConvPath::Cudnn),
        present && p.info(ConvPath::Cudnn).why_not.is_none(),
        "{ctx}"
    );
    if !present {
        assert!(!p.eligible(ConvPath::Cudnn), "{ctx}");
    }
    if p.direction != Direction::Forward {
        assert!(!p.eligible(ConvPath::Direct), "{ctx}");
    } else {
        assert!(p.eligible(ConvPath::Direct), "{ctx}");
    }
    for t in WinogradTile::ALL {
        let info = p.info(ConvPath::winograd(t));
        let shape_ok = p.shape.format == TensorFormat::Nhwc
            && (p.shape.kh, p.shape.kw) == (3, 3)
            && p.shape.stride == (1, 1)
            && p.shape.dilation == (1, 1)
            && match p.direction {
                Direction::Forward => true,
                Direction::BackwardData => p.shape.pad.0 <= 2 && p.shape.pad.1 <= 2,
                Direction::BackwardFilter => false,
            };
        if !shape_ok {
            assert!(!info.eligible, "{ctx}: {t:?}");
        }
        if info.eligible {
            let w = info.winograd.as_ref().unwrap();
            assert!(info.scratch_bytes <= p.workspace_cap_bytes, "{ctx}");
            let other = match w.seed_engine {
                WinogradEngine::TensorCore => WinogradEngine::Direct,
                WinogradEngine::Direct => WinogradEngine::TensorCore,
                WinogradEngine::Fused => panic!("{ctx}: the seed's rule never says fused"),
            };
            let fused_ok =
                matches!(p.dtype, DType::F16 | DType::BF16) && w.c_in % 8 == 0 && w.c_out % 8 == 0;
            assert_eq!(w.fused_why_not.is_none(), fused_ok, "{ctx}");
            let want = match p.winograd_gemm {
                WinogradGemmPolicy::Auto if fused_ok => {
                    vec![w.seed_engine, other, WinogradEngine::Fused]
                }
                WinogradGemmPolicy::Auto => vec![w.seed_engine, other],
                WinogradGemmPolicy::Seed => vec![w.seed_engine],
                WinogradGemmPolicy::TensorCore => vec![WinogradEngine::TensorCore],
                WinogradGemmPolicy::Direct => vec![WinogradEngine::Direct],
                WinogradGemmPolicy::Fused if fused_ok => vec![WinogradEngine::Fused],
                WinogradGemmPolicy::Fused => vec![w.seed_engine],
            };
            assert_eq!(w.engines, want, "{ctx}");
            assert_eq!(
                w.seed_engine == WinogradEngine::TensorCore,
                w.seed_rule.is_some(),
                "{ctx}"
            );
        }
    }
    let im = p.info(ConvPath::Im2colGemm);
    if im.eligible {
        assert!(im.scratch_bytes <= p.workspace_cap_bytes, "{ctx}");
        assert!(im.chunks >= 1 && im.chunk.unwrap() >= 1, "{ctx}");
    }
    // The policy's own paths are taken when they can run.
    let own: &[ConvPath] = match p.policy {
        ConvAlgoPolicy::Auto => &[],
        ConvAlgoPolicy::Cudnn => &[ConvPath::Cudnn],
        ConvAlgoPolicy::Im2col => &[ConvPath::Im2colGemm],
        ConvAlgoPolicy::Winograd => &[ConvPath::WinogradF4x3, ConvPath::WinogradF2x3],
        ConvAlgoPolicy::WinogradF2x3 => &[ConvPath::WinogradF2x3],
        ConvAlgoPolicy::WinogradF4x3 => &[ConvPath::WinogradF4x3],
        ConvAlgoPolicy::Direct => &[ConvPath::Direct],
        ConvAlgoPolicy::CudnnDual => &[ConvPath::CudnnDual],
        ConvAlgoPolicy::DirectFilter => &[ConvPath::DirectFilter],
        ConvAlgoPolicy::CudnnTiled => &[ConvPath::CudnnTiled],
        ConvAlgoPolicy::StemFilter => &[ConvPath::StemFilter],
        ConvAlgoPolicy::StemForward => &[ConvPath::StemForward],
    };
    if !own.is_empty() {
        if own.iter().any(|&q| p.eligible(q)) {
            assert!(p.fallback.is_none(), "{ctx}");
            assert!(p.candidates.iter().all(|r| own.contains(&r.path)), "{ctx}");
        } else {
            assert!(p.fallback.is_some(), "{ctx}");
            let expect = if p.eligible(ConvPath::Cudnn) {
                ConvPath::Cudnn
            } else if p.direction == Direction::Forward {
                ConvPath::Direct
            } else {
                ConvPath::Im2colGemm
            };
            assert_eq!(p.path, expect, "{ctx}");
        }
    } else if p.runnable {
        // auto: cuDNN leads when it can run, except before the f32 NCHW pointwise filter
        // gradient in pieces (which says so).
        if p.eligible(ConvPath::Cudnn) {
            let lead = if has_reason(p, "in pieces") {
                assert!(
                    p.direction == Direction::BackwardFilter
                        && p.shape.format == TensorFormat::Nchw
                        && p.shape.kh == 1
                        && p.shape.kw == 1,
                    "{ctx}"
                );
                ConvPath::Im2colGemm
            } else {
                ConvPath::Cudnn
            };
            assert_eq!(p.path, lead, "{ctx}");
        }
        for q in [
            ConvPath::Im2colGemm,
            ConvPath::WinogradF2x3,
            ConvPath::WinogradF4x3,
        ] {
            if p.eligible(q) {
                assert!(
                    p.candidates.iter().any(|r| r.path == q),
                    "{ctx}: {q} missing"
                );
            }
        }
    }
    // Text and JSON carry the decision.
    let j = p.to_json();
    for key in [
        "direction",
        "dtype",
        "path",
        "engine",
        "measured",
        "candidates",
        "paths",
        "fallback",
        "runnable",
        "reasons",
        "policy",
        "winograd_gemm",
        "deterministic",
        "workspace_cap_bytes",
        "cudnn_present",
        "scratch_bytes",
        "flops",
    ] {
        assert!(j.get(key).is_some(), "{ctx}: JSON lacks {key}");
    }
    assert_eq!(j["path"], p.path.name());
    assert!(p.to_string().contains(p.path.name()), "{ctx}");
    assert!(!p.reasons.is_empty());
    // Plans cite only files of this repository.
    for r in &p.reasons {
        assert!(!r.contains("../"), "{ctx}: {r}");
    }
}

#[test]
fn fallback_route_prefers_cudnn_then_own() {
    let s = shape(2, 8, 9, 8, 3, NHWC);
    let p = plan_of(s, DType::F16, Direction::Forward, &Config::default(), true);
    assert_eq!(
        p.fallback_route(ConvPath::WinogradF4x3).unwrap().path,
        ConvPath::Cudnn
    );
    assert_eq!(
        p.fallback_route(ConvPath::Cudnn).unwrap().path,
        ConvPath::Direct
    );
    let p = plan_of(
        s,
        DType::F16,
        Direction::BackwardData,
        &Config::default(),
        false,
    );
    assert_eq!(
        p.fallback_route(ConvPath::WinogradF2x3).unwrap().path,
        ConvPath::Im2colGemm
    );
    assert!(p.fallback_route(ConvPath::Im2colGemm).is_none());
}

#[test]
fn names_parse_back() {
    for p in ConvPath::ALL {
        assert_eq!(p.name().parse::<ConvPath>().unwrap(), p);
    }
    for d in Direction::ALL {
        assert_eq!(d.name().parse::<Direction>().unwrap(), d);
    }
    assert_eq!(
        "backward-data".parse::<Direction>().unwrap(),
        Direction::BackwardData
    );
    assert_eq!("im2col".parse::<ConvPath>().unwrap(), ConvPath::Im2colGemm);
    assert_eq!(
        "fft".parse::<ConvPath>().unwrap_err().argument(),
        Some("path")
    );
    assert_eq!(
        "up".parse::<Direction>().unwrap_err().argument(),
        Some("direction")
    );
}

/// `plan_of` with the graph API's availability given.
fn plan_with_graph(s: ConvShape, direction: Direction, config: &Config, graph: bool) -> ConvPlan {
    plan(&ConvPlanRequest {
        shape: s,
        dtype: DType::F16,
        direction,
        config,
        cudnn_present: true,
        cudnn_graph: graph,
    })
    .unwrap_or_else(|e| panic!("{s:?} {direction}: {e}"))
}

#[test]
fn the_cudnn_candidate_goes_through_the_graph_api_where_it_can() {
    use nnfuse::config::CudnnApi;
    let s = shape(32, 64, 56, 64, 3, NHWC);
    for d in Direction::ALL {
        // Default (auto) with cuDNN 9: the graph API; the candidates are unchanged.
        let p = plan_with_graph(s, d, &Config::default(), true);
        assert!(p.cudnn_graph, "{d}:\n{p}");
        assert_eq!(p.cudnn_api, CudnnApi::Auto);
        assert_eq!(p.cudnn_api_used(), Some("graph"));
        assert_eq!(p.candidates[0].path, ConvPath::Cudnn, "{d}");
        assert!(p.candidates.iter().all(|r| r.path != ConvPath::CudnnGraph));
        assert!(p.eligible(ConvPath::CudnnGraph), "{d}");
        assert_eq!(p.paths.len(), 10);
        assert_eq!(p.api_paths.len(), 1);
        assert_eq!(p.api_paths[0].path, ConvPath::CudnnGraph);
        assert!(has_reason(&p, "cuDNN API graph"), "{p}");
        assert!(has_reason(&p, "cudnn_graph: cuDNN's graph"), "{p}");
        let j = p.to_json();
        assert_eq!(j["cudnn_api"], "auto");
        assert_eq!(j["cudnn_api_used"], "graph");
        assert_eq!(j["api_paths"][0]["path"], "cudnn_graph");
        assert_eq!(j["api_paths"][0]["eligible"], true);
        assert!(p.to_string().contains("cuDNN API graph (auto)"), "{p}");
        // A graph route that fails falls back to the legacy calls.
        assert_eq!(
            p.fallback_route(ConvPath::CudnnGraph).unwrap().path,
            ConvPath::Cudnn
        );

        // legacy: the graph path is not eligible and the plan says why.
        let legacy = Config::default().with_cudnn_api(CudnnApi::Legacy);
        let p = plan_with_graph(s, d, &legacy, true);
        assert!(!p.cudnn_graph && !p.eligible(ConvPath::CudnnGraph), "{p}");
        assert_eq!(p.cudnn_api_used(), Some("legacy"));
        assert!(why(&p, ConvPath::CudnnGraph).contains("legacy"), "{p}");
        assert!(has_reason(&p, "cuDNN API legacy (legacy)"), "{p}");
        assert!(!has_reason(&p, "cudnn_graph: cuDNN's graph"), "{p}");

        // A cuDNN without the graph API: legacy under auto, and graph is not honoured.
        let p = plan_with_graph(s, d, &Config::default(), false);
        assert!(!p.cudnn_graph, "{p}");
        assert!(
            why(&p, ConvPath::CudnnGraph).contains("no graph API"),
            "{p}"
        );
        assert!(has_reason(&p, "cuDNN API legacy (auto)"), "{p}");
        let graph = Config::default().with_cudnn_api(CudnnApi::Graph);
        let p = plan_with_graph(s, d, &graph, false);
        assert!(has_reason(&p, "graph is not honoured"), "{p}");
        let p = plan_with_graph(s, d, &graph, true);
        assert!(p.cudnn_graph, "{p}");

        // The cudnn policy takes the graph API too; a policy without cuDNN uses no API.
        let forced = Config::default().with_conv_algo(ConvAlgoPolicy::Cudnn);
        let p = plan_with_graph(s, d, &forced, true);
        assert!(p.cudnn_graph && !p.measured, "{p}");
        assert_eq!(p.candidates.len(), 1);
        let own = Config::default().with_conv_algo(ConvAlgoPolicy::Im2col);
        let p = plan_with_graph(s, d, &own, true);
        assert!(!p.cudnn_graph, "{p}");
        assert_eq!(p.cudnn_api_used(), None);
        assert!(!has_reason(&p, "cuDNN API"), "{p}");
    }
    // Without cuDNN nothing of it is eligible.
    let p = plan_of(s, DType::F16, Direction::Forward, &Config::default(), false);
    assert!(!p.cudnn_graph && !p.eligible(ConvPath::CudnnGraph));
    assert!(why(&p, ConvPath::CudnnGraph).contains("cannot be loaded"));
    // cuDNN's int limits hold for the graph API as for the legacy one.
    let big = ConvShape {
        n: 1 << 31,
        ..shape(1, 3, 5, 8, 3, NCHW)
    };
    let p = plan_with_graph(big, Direction::Forward, &Config::default(), true);
    assert!(!p.eligible(ConvPath::CudnnGraph) && !p.cudnn_graph, "{p}");
}

/// f32 takes the graph API like the halves (it used to be refused for an engine config that
/// measured 6.6e-4 from f64): the plan says what f32 on the graph route means — true f32, each
/// engine config checked against a true-f32 route within a bound that grows with the sum's
/// length — and only the graph API's own conditions refuse it.
#[test]
fn f32_takes_the_graph_api_and_the_plan_says_it_means_true_f32() {
    use nnfuse::config::CudnnApi;
    // Direction, shape, the bound the reasons name: 1e-5 for short sums, more for the filter
    // gradient of a large batch (n*oh*ow products per element).
    let cases = [
        (
            Direction::Forward,
            shape(32, 512, 7, 512, 3, NCHW),
            "1.0e-5",
        ),
        (
            Direction::BackwardData,
            shape(8, 128, 28, 128, 3, NCHW),
            "1.0e-5",
        ),
        (
            Direction::BackwardFilter,
            shape(5, 64, 31, 1, 5, NCHW),
            "1.0e-5",
        ),
        (
            Direction::BackwardFilter,
            shape(16, 256, 56, 256, 3, NCHW),
            "2.7e-5",
        ),
        (
            Direction::BackwardFilter,
            shape(256, 64, 56, 64, 3, NHWC),
            "5.0e-5",
        ),
    ];
    for (d, s, bound) in cases {
        let p = plan_of(s, DType::F32, d, &Config::default(), true);
        assert!(
            p.cudnn_graph && p.eligible(ConvPath::CudnnGraph),
            "{d}:\n{p}"
        );
        assert_eq!(p.cudnn_api_used(), Some("graph"), "{d}");
        assert_eq!(p.candidates[0].path, ConvPath::Cudnn, "{d}");
        assert!(
            has_reason(&p, "cudnn_graph f32 means true f32"),
            "{d}:\n{p}"
        );
        assert!(
            has_reason(&p, &format!("relative L2 error of {bound}")),
            "{d} {s:?}: bound {bound}:\n{p}"
        );
        assert!(
            !why(&p, ConvPath::CudnnGraph).starts_with("f32"),
            "{d}:\n{p}"
        );
        // The halves' plans do not carry the f32 line.
        let h = plan_of(s, DType::F16, d, &Config::default(), true);
        assert!(!has_reason(&h, "cudnn_graph f32"), "{d}:\n{h}");
        // legacy still refuses the graph API for f32, with its own reason.
        let legacy = Config::default().with_cudnn_api(CudnnApi::Legacy);
        let p = plan_of(s, DType::F32, d, &legacy, true);
        assert!(!p.eligible(ConvPath::CudnnGraph), "{d}:\n{p}");
        assert!(
            why(&p, ConvPath::CudnnGraph).contains("legacy"),
            "{d}:\n{p}"
        );
    }
    // A cuDNN without the graph API: refused for f32 as for the halves.
    let s = shape(8, 128, 28, 128, 3, NCHW);
    let p = plan(&ConvPlanRequest {
        shape: s,
        dtype: DType::F32,
        direction: Direction::BackwardFilter,
        config: &Config::default(),
        cudnn_present: true,
        cudnn_graph: false,
    })
    .unwrap();
    assert!(
        why(&p, ConvPath::CudnnGraph).contains("no graph API"),
        "{p}"
    );
}

#[test]
fn graph_routes_name_their_engine_config() {
    use nnfuse::conv::{GraphEngine, Route};
    assert_eq!(
        "cudnn_graph".parse::<ConvPath>().unwrap(),
        ConvPath::CudnnGraph
    );
    assert_eq!("graph".parse::<ConvPath>().unwrap(), ConvPath::CudnnGraph);
    assert!(!ConvPath::CudnnGraph.is_own() && ConvPath::CudnnGraph.is_cudnn());
    assert!(ConvPath::Cudnn.is_cudnn() && !ConvPath::Im2colGemm.is_cudnn());
    let e = GraphEngine::new(45, &[]).unwrap();
    let r = Route::graph(e);
    assert_eq!(r.path, ConvPath::CudnnGraph);
    assert_eq!(r.graph_engine, Some(e));
    assert_eq!(r.label(), "cudnn_graph:eng45{}");
    assert_eq!(Route::path(ConvPath::CudnnGraph).label(), "cudnn_graph");
    assert!(Route::path(ConvPath::Cudnn).graph_engine.is_none());
}

/// The direct and im2col rules refuse what their launchers refuse: the kernels' 32-bit
/// per-image indices and `int` coordinates (the launchers run the same check, or, for im2col,
/// its per-image limits beyond the GEMM's), so a plan never calls runnable what no path runs.
#[test]
fn own_kernels_refuse_what_their_launchers_refuse() {
    let cfg = Config::default();
    // The example: 1,3,8,8,4,3,3 with pad 1000000 (oh*ow ~ 4e12).
    let s = ConvShape {
        pad: (1_000_000, 1_000_000),
        ..shape(1, 3, 8, 4, 3, NCHW)
    };
    for present in [false, true] {
        let p = plan_of(s, DType::F32, Direction::Forward, &cfg, present);
        assert!(!p.eligible(ConvPath::Direct), "{present}: {p}");
        assert!(why(&p, ConvPath::Direct).contains("oh*ow"), "{p}");
        assert!(why(&p, ConvPath::Direct).contains("32-bit per-image indices"));
        assert!(!p.runnable, "{present}: {p}");
        assert!(p.to_string().contains("NOT RUNNABLE"));
    }
    // Only the padded height is over the limit (the output is 2x2): direct and im2col were
    // eligible by their rules while their launchers refuse it.
    for fmt in [NCHW, NHWC] {
        let s = ConvShape {
            pad: (1 << 30, 0),
            stride: (i32::MAX as usize, 1),
            ..shape(1, 3, 8, 4, 3, fmt)
        };
        assert_eq!(s.out_hw().unwrap().0, 2);
        let p = plan_of(s, DType::F32, Direction::Forward, &cfg, false);
        for path in [ConvPath::Direct, ConvPath::Im2colGemm] {
            assert!(!p.eligible(path), "{fmt:?} {path}: {p}");
            assert!(why(&p, path).contains("h + 2*pad.0"), "{path}: {p}");
        }
        assert!(!p.runnable, "{p}");
        // Within the limits, both stay eligible.
        let s = ConvShape {
            pad: (1 << 29, 0),
            ..s
        };
        let p = plan_of(s, DType::F32, Direction::Forward, &cfg, false);
        assert!(
            p.eligible(ConvPath::Direct) && p.eligible(ConvPath::Im2colGemm),
            "{p}"
        );
        assert!(p.runnable);
    }
    // Winograd's kernels take a padded extent of at most i32::MAX / 2 (int tile coordinates):
    // over it, Winograd is refused even under an unbounded cap, while the direct kernel runs.
    let big_cap = Config::default().with_conv_workspace_mb(usize::MAX);
    let s = ConvShape {
        w: 1,
        pad: (1 << 29, 1),
        ..shape(1, 8, 8, 8, 3, NHWC)
    };
    let p = plan_of(s, DType::F16, Direction::Forward, &big_cap, false);
    for path in [ConvPath::WinogradF2x3, ConvPath::WinogradF4x3] {
        assert!(!p.eligible(path), "{path}: {p}");
        assert!(why(&p, path).contains("h + 2*pad.0"), "{path}: {p}");
    }
    assert!(p.eligible(ConvPath::Direct), "{p}");
    let s = ConvShape {
        pad: ((1 << 29) - 8, 1),
        ..s
    };
    let p = plan_of(s, DType::F16, Direction::Forward, &big_cap, false);
    assert!(p.eligible(ConvPath::WinogradF2x3), "{p}");
}

/// Which paths can run an accumulating gradient (added to dx or dw), with the reason for those
/// that cannot: Winograd's data gradient cannot (its output transform has no beta); cuDNN, the
/// graph API and im2col + GEMM can, in both gradients; the forward never accumulates. Every
/// fallback a gradient can take accumulates (an accumulating call's substitute and fallback).
#[test]
fn accumulating_gradients_refuse_winograd_with_a_reason() {
    let cfg = Config::default();
    let s = shape(8, 64, 28, 64, 3, NHWC);
    for dtype in [DType::F16, DType::BF16, DType::F32] {
        for cudnn in [true, false] {
            let data = plan_of(s, dtype, Direction::BackwardData, &cfg, cudnn);
            for tile in [ConvPath::WinogradF2x3, ConvPath::WinogradF4x3] {
                let why = data.accumulate_refusal(tile).unwrap_or_default();
                assert!(why.contains("cannot add to dx"), "{tile} {dtype}: {why:?}");
            }
            for path in [ConvPath::Cudnn, ConvPath::CudnnGraph, ConvPath::Im2colGemm] {
                assert_eq!(data.accumulate_refusal(path), None, "{path} {dtype}");
            }
            for failed in ConvPath::ALL {
                if let Some(fb) = data.fallback_route(failed) {
                    assert_eq!(data.accumulate_refusal(fb.path), None, "{failed} -> {fb}");
                }
            }
            let filter = plan_of(s, dtype, Direction::BackwardFilter, &cfg, cudnn);
            for path in [ConvPath::Cudnn, ConvPath::CudnnGraph, ConvPath::Im2colGemm] {
                assert_eq!(filter.accumulate_refusal(path), None, "{path} {dtype}");
            }
            let fwd = plan_of(s, dtype, Direction::Forward, &cfg, cudnn);
            for path in ConvPath::ALL {
                assert!(fwd.accumulate_refusal(path).is_some(), "{path}");
            }
            assert!(data
                .accumulate_refusal(ConvPath::Direct)
                .is_some_and(|w| w.contains("forward only")));
        }
    }
}

/// The forward as a data gradient (`cudnn_dual`): a measured candidate of f32 stride-1 forwards
/// on the graph API, with its scratch (the dual filter) and reason; refused, with the reason,
/// for the gradients, stride 2, f16, a padding beyond the filter's reach, the legacy API and a
/// cuDNN without the graph API; forced by `cudnn_dual`.
#[test]
fn the_dual_forward_is_an_f32_stride_one_graph_candidate() {
    use nnfuse::config::CudnnApi;
    let s = shape(32, 64, 56, 48, 3, NCHW);
    let req = |s: ConvShape, dtype, direction, config: &Config, graph| {
        plan(&ConvPlanRequest {
            shape: s,
            dtype,
            direction,
            config,
            cudnn_present: true,
            cudnn_graph: graph,
        })
        .unwrap()
    };
    let cfg = Config::default();
    let p = req(s, DType::F32, Direction::Forward, &cfg, true);
    assert!(
        p.candidates.iter().any(|r| r.path == ConvPath::CudnnDual),
        "{p}"
    );
    assert_eq!(p.info(ConvPath::CudnnDual).scratch_bytes, 48 * 64 * 9 * 4);
    assert!(
        has_reason(&p, "cudnn_dual: the forward as cuDNN's data gradient"),
        "{p}"
    );
    for d in [Direction::BackwardData, Direction::BackwardFilter] {
        let p = req(s, DType::F32, d, &cfg, true);
        assert!(why(&p, ConvPath::CudnnDual).contains("forward only"), "{p}");
    }
    let strided = ConvShape {
        stride: (2, 2),
        ..s
    };
    let p = req(strided, DType::F32, Direction::Forward, &cfg, true);
    assert!(why(&p, ConvPath::CudnnDual).contains("stride"), "{p}");
    let p = req(s, DType::F16, Direction::Forward, &cfg, true);
    assert!(why(&p, ConvPath::CudnnDual).contains("f32 only"), "{p}");
    let wide = ConvShape { pad: (3, 1), ..s };
    let p = req(wide, DType::F32, Direction::Forward, &cfg, true);
    assert!(why(&p, ConvPath::CudnnDual).contains("padding"), "{p}");
    let legacy = Config::default().with_cudnn_api(CudnnApi::Legacy);
    let p = req(s, DType::F32, Direction::Forward, &legacy, true);
    assert!(why(&p, ConvPath::CudnnDual).contains("legacy"), "{p}");
    let p = req(s, DType::F32, Direction::Forward, &cfg, false);
    assert!(why(&p, ConvPath::CudnnDual).contains("no graph API"), "{p}");
    let forced = Config::default().with_conv_algo(ConvAlgoPolicy::CudnnDual);
    let p = req(s, DType::F32, Direction::Forward, &forced, true);
    assert_eq!(p.path, ConvPath::CudnnDual, "{p}");
    assert_eq!(p.candidates.len(), 1, "{p}");
    assert_eq!("dual".parse::<ConvPath>().unwrap(), ConvPath::CudnnDual);
    assert_eq!(
        "cudnn_dual".parse::<ConvAlgoPolicy>().unwrap(),
        ConvAlgoPolicy::CudnnDual
    );
}

/// nnfuse's filter-gradient kernel (`direct_filter`): a candidate of f32 3x3 stride-1 filter
/// gradients, measured right after cuDNN's incumbent in decisions, with its scratch (one
/// partial filter gradient per range of rows) and reason; refused, with the reason, for the
/// forward and the data gradient, f16, a 5x5 filter, stride 2 and a cap below one partial sum;
/// forced by `direct_filter`, with the other directions falling back.
#[test]
fn the_filter_gradient_kernel_is_an_f32_3x3_stride_one_candidate() {
    let s = shape(32, 64, 56, 64, 3, NCHW);
    let cfg = Config::default();
    let p = plan_of(s, DType::F32, Direction::BackwardFilter, &cfg, true);
    assert!(
        p.candidates
            .iter()
            .any(|r| r.path == ConvPath::DirectFilter),
        "{p}"
    );
    // 132 ranges of rows (264 blocks over 2 channel tiles), a 64x64x3x3 f32 filter each.
    assert_eq!(
        p.info(ConvPath::DirectFilter).scratch_bytes,
        132 * 64 * 64 * 9 * 4
    );
    assert!(
        has_reason(&p, "direct_filter: nnfuse's filter-gradient kernel"),
        "{p}"
    );
    assert!(
        p.accumulate_refusal(ConvPath::DirectFilter).is_none(),
        "{p}"
    );
    for d in [Direction::Forward, Direction::BackwardData] {
        let p = plan_of(s, DType::F32, d, &cfg, true);
        assert!(
            why(&p, ConvPath::DirectFilter).contains("filter gradient only"),
            "{p}"
        );
    }
    let p = plan_of(s, DType::F16, Direction::BackwardFilter, &cfg, true);
    assert!(why(&p, ConvPath::DirectFilter).contains("f32 only"), "{p}");
    let p = plan_of(
        shape(8, 16, 20, 16, 5, NHWC),
        DType::F32,
        Direction::BackwardFilter,
        &cfg,
        true,
    );
    assert!(why(&p, ConvPath::DirectFilter).contains("5x5"), "{p}");
    let strided = ConvShape {
        stride: (2, 2),
        ..s
    };
    let p = plan_of(strided, DType::F32, Direction::BackwardFilter, &cfg, true);
    assert!(why(&p, ConvPath::DirectFilter).contains("stride"), "{p}");
    let forced = Config::default().with_conv_algo(ConvAlgoPolicy::DirectFilter);
    let p = plan_of(s, DType::F32, Direction::BackwardFilter, &forced, true);
    assert_eq!(p.path, ConvPath::DirectFilter, "{p}");
    assert_eq!(p.candidates.len(), 1, "{p}");
    let p = plan_of(s, DType::F32, Direction::Forward, &forced, true);
    assert_ne!(p.path, ConvPath::DirectFilter, "{p}");
    assert!(p.fallback.is_some(), "{p}");
    assert_eq!(
        "direct_wgrad".parse::<ConvPath>().unwrap(),
        ConvPath::DirectFilter
    );
    assert_eq!(
        "direct_filter".parse::<ConvAlgoPolicy>().unwrap(),
        ConvAlgoPolicy::DirectFilter
    );
}

/// ResNet-50's stem at batch 32 (7x7/2, 3 → 64 channels at 224x224, channels-last): the
/// few-channel kernels' reference problem.
fn resnet_stem() -> ConvShape {
    ConvShape {
        stride: (2, 2),
        ..ConvShape::square(32, 3, 224, 64, 7, NHWC)
    }
}

/// nnfuse's stem filter-gradient kernel (`stem_filter`): a candidate of f16 / bf16
/// channels-last filter gradients with few input channels (ResNet's 7x7/2 stem), measured right
/// after the incumbent, with its scratch (one partial filter gradient per range of row
/// segments) and reason; refused, with the reason, for the other directions, f32, NCHW and a
/// 7x7 filter over 4 channels (196 columns); forced by `stem_filter`, the other directions
/// falling back.
#[test]
fn the_stem_filter_gradient_is_a_candidate_of_few_channel_half_layers() {
    let stem = resnet_stem();
    let cfg = Config::default();
    for dt in [DType::F16, DType::BF16] {
        let p = plan_of(stem, dt, Direction::BackwardFilter, &cfg, true);
        let i = p
            .candidates
            .iter()
            .position(|r| r.path == ConvPath::StemFilter)
            .unwrap_or_else(|| panic!("{p}"));
        assert!(i >= 1, "{p}");
        // 264 ranges of rows, a 64 x 147 f32 filter gradient each.
        assert_eq!(
            p.info(ConvPath::StemFilter).scratch_bytes,
            264 * 64 * 147 * 4
        );
        assert!(has_reason(&p, "stem_filter: nnfuse's tensor-core"), "{p}");
        assert!(p.accumulate_refusal(ConvPath::StemFilter).is_none(), "{p}");
    }
    for d in [Direction::Forward, Direction::BackwardData] {
        let p = plan_of(stem, DType::F16, d, &cfg, true);
        assert!(
            why(&p, ConvPath::StemFilter).contains("filter gradient only"),
            "{p}"
        );
    }
    let p = plan_of(stem, DType::F32, Direction::BackwardFilter, &cfg, true);
    assert!(
        why(&p, ConvPath::StemFilter).contains("f16 and bf16 only"),
        "{p}"
    );
    let nchw = ConvShape {
        format: NCHW,
        ..stem
    };
    let p = plan_of(nchw, DType::F16, Direction::BackwardFilter, &cfg, true);
    assert!(
        why(&p, ConvPath::StemFilter).contains("channels-last"),
        "{p}"
    );
    let wide = ConvShape { c_in: 4, ..stem };
    let p = plan_of(wide, DType::F16, Direction::BackwardFilter, &cfg, true);
    assert!(why(&p, ConvPath::StemFilter).contains("196 columns"), "{p}");
    let forced = Config::default().with_conv_algo(ConvAlgoPolicy::StemFilter);
    let p = plan_of(stem, DType::F16, Direction::BackwardFilter, &forced, true);
    assert_eq!(p.path, ConvPath::StemFilter, "{p}");
    assert_eq!(p.candidates.len(), 1, "{p}");
    let p = plan_of(stem, DType::F16, Direction::Forward, &forced, true);
    assert_ne!(p.path, ConvPath::StemFilter, "{p}");
    assert!(p.fallback.is_some(), "{p}");
    assert_eq!(
        "stem_wgrad".parse::<ConvPath>().unwrap(),
        ConvPath::StemFilter
    );
    assert_eq!(
        "stem_filter".parse::<ConvAlgoPolicy>().unwrap(),
        ConvAlgoPolicy::StemFilter
    );
}

/// nnfuse's stem forward kernel (`stem_forward`): a candidate of f16 / bf16 channels-last
/// forwards with few input channels, measured right after the incumbent, with no scratch and
/// its reason; refused, with the reason, for the gradients, f32 and NCHW; forced by
/// `stem_forward`, the gradients falling back.
#[test]
fn the_stem_forward_is_a_candidate_of_few_channel_half_layers() {
    let stem = resnet_stem();
    let cfg = Config::default();
    for dt in [DType::F16, DType::BF16] {
        let p = plan_of(stem, dt, Direction::Forward, &cfg, true);
        let i = p
            .candidates
            .iter()
            .position(|r| r.path == ConvPath::StemForward)
            .unwrap_or_else(|| panic!("{p}"));
        assert!(i >= 1, "{p}");
        assert_eq!(p.info(ConvPath::StemForward).scratch_bytes, 0);
        assert!(
            has_reason(&p, "stem_forward: nnfuse's tensor-core forward"),
            "{p}"
        );
    }
    for d in [Direction::BackwardData, Direction::BackwardFilter] {
        let p = plan_of(stem, DType::F16, d, &cfg, true);
        assert!(
            why(&p, ConvPath::StemForward).contains("forward only"),
            "{p}"
        );
    }
    let p = plan_of(stem, DType::F32, Direction::Forward, &cfg, true);
    assert!(
        why(&p, ConvPath::StemForward).contains("f16 and bf16 only"),
        "{p}"
    );
    let nchw = ConvShape {
        format: NCHW,
        ..stem
    };
    let p = plan_of(nchw, DType::BF16, Direction::Forward, &cfg, true);
    assert!(
        why(&p, ConvPath::StemForward).contains("channels-last"),
        "{p}"
    );
    let forced = Config::default().with_conv_algo(ConvAlgoPolicy::StemForward);
    let p = plan_of(stem, DType::F16, Direction::Forward, &forced, true);
    assert_eq!(p.path, ConvPath::StemForward, "{p}");
    assert_eq!(p.candidates.len(), 1, "{p}");
    let p = plan_of(stem, DType::F16, Direction::BackwardFilter, &forced, true);
    assert_ne!(p.path, ConvPath::StemForward, "{p}");
    assert!(p.fallback.is_some(), "{p}");
    assert_eq!(
        "stem_fwd".parse::<ConvPath>().unwrap(),
        ConvPath::StemForward
    );
}

/// The filter gradient over 2x2 tiles (`cudnn_tiled`): a candidate of f32 stride-1 filter
/// gradients with outputs of at least 32x32 on the graph API, with its scratch (the tiled x and
/// dy) and reason; refused, with the reason, for the other directions, bf16, stride 2, a small
/// output, the legacy API and a cap below its scratch; forced by `cudnn_tiled`.
#[test]
fn the_tiled_filter_gradient_is_an_f32_graph_candidate() {
    use nnfuse::config::CudnnApi;
    let s = shape(32, 64, 56, 64, 3, NCHW);
    let cfg = Config::default();
    let p = plan_of(s, DType::F32, Direction::BackwardFilter, &cfg, true);
    assert!(
        p.candidates.iter().any(|r| r.path == ConvPath::CudnnTiled),
        "{p}"
    );
    // 128 windows of 64x30x30 and 128 quarters of 64x28x28, f32.
    let x = (128 * 64 * 30 * 30 * 4usize).next_multiple_of(256);
    assert_eq!(
        p.info(ConvPath::CudnnTiled).scratch_bytes,
        x + 128 * 64 * 28 * 28 * 4
    );
    assert!(
        has_reason(&p, "cudnn_tiled: the filter gradient as cuDNN's"),
        "{p}"
    );
    assert!(has_reason(&p, "128 images of 30x30"), "{p}");
    assert!(p.accumulate_refusal(ConvPath::CudnnTiled).is_none(), "{p}");
    for d in [Direction::Forward, Direction::BackwardData] {
        let p = plan_of(s, DType::F32, d, &cfg, true);
        assert!(
            why(&p, ConvPath::CudnnTiled).contains("filter gradient only"),
            "{p}"
        );
    }
    let p = plan_of(s, DType::BF16, Direction::BackwardFilter, &cfg, true);
    assert!(why(&p, ConvPath::CudnnTiled).contains("f32 only"), "{p}");
    let strided = ConvShape {
        stride: (2, 2),
        ..s
    };
    let p = plan_of(strided, DType::F32, Direction::BackwardFilter, &cfg, true);
    assert!(why(&p, ConvPath::CudnnTiled).contains("stride"), "{p}");
    let p = plan_of(
        shape(32, 64, 28, 64, 3, NCHW),
        DType::F32,
        Direction::BackwardFilter,
        &cfg,
        true,
    );
    assert!(
        why(&p, ConvPath::CudnnTiled).contains("at least 32x32"),
        "{p}"
    );
    let legacy = Config::default().with_cudnn_api(CudnnApi::Legacy);
    let p = plan_of(s, DType::F32, Direction::BackwardFilter, &legacy, true);
    assert!(why(&p, ConvPath::CudnnTiled).contains("legacy"), "{p}");
    let small_cap = Config::default().with_conv_workspace_mb(16);
    let p = plan_of(s, DType::F32, Direction::BackwardFilter, &small_cap, true);
    assert!(
        why(&p, ConvPath::CudnnTiled).contains("workspace cap"),
        "{p}"
    );
    let forced = Config::default().with_conv_algo(ConvAlgoPolicy::CudnnTiled);
    let p = plan_of(s, DType::F32, Direction::BackwardFilter, &forced, true);
    assert_eq!(p.path, ConvPath::CudnnTiled, "{p}");
    assert_eq!(p.candidates.len(), 1, "{p}");
    assert_eq!("tiled".parse::<ConvPath>().unwrap(), ConvPath::CudnnTiled);
    assert_eq!(
        "cudnn_tiled".parse::<ConvAlgoPolicy>().unwrap(),
        ConvAlgoPolicy::CudnnTiled
    );
}
