//! The folded conv+BN inference unit without a GPU: the folding math against a direct f64
//! BatchNorm of the convolution, the reference's argument errors, and the plan's eligibility
//! and reasons.

mod common;

use nnfuse::block::{fold, plan, reference_forward, BlockRoute, BnHost};
use nnfuse::conv::ConvShape;
use nnfuse::internals::block::{tolerance, MAX_COLUMN_BYTES};
use nnfuse::reference::conv::conv2d;
use nnfuse::{DType, TensorFormat};

fn shape(kh: usize, stride: usize, pad: usize, format: TensorFormat) -> ConvShape {
    ConvShape {
        n: 2,
        c_in: 3,
        h: 5,
        w: 4,
        c_out: 4,
        kh,
        kw: kh,
        stride: (stride, stride),
        pad: (pad, pad),
        dilation: (1, 1),
        format,
    }
}

fn values(seed: u64, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            lo + (hi - lo) * ((s >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect()
}

struct Bn {
    gamma: Vec<f64>,
    beta: Vec<f64>,
    mean: Vec<f64>,
    var: Vec<f64>,
}

impl Bn {
    fn new(k: usize, seed: u64) -> Bn {
        Bn {
            gamma: values(seed, k, 0.5, 1.5),
            beta: values(seed + 1, k, -0.5, 0.5),
            mean: values(seed + 2, k, -0.3, 0.3),
            var: values(seed + 3, k, 0.2, 2.0),
        }
    }
    fn host(&self, eps: f64) -> BnHost<'_> {
        BnHost {
            gamma: &self.gamma,
            beta: &self.beta,
            running_mean: &self.mean,
            running_var: &self.var,
            eps,
        }
    }
}

/// conv(x, w') + b' equals bn(conv(x, w)) in f64 (to rounding), in both layouts, with and
/// without padding and stride; the reference adds the shortcut and applies ReLU after.
#[test]
fn folding_equals_batchnorm_of_the_convolution() {
    for format in [TensorFormat::Nchw, TensorFormat::Nhwc] {
        for (kh, stride, pad) in [(1, 1, 0), (3, 1, 1), (3, 2, 1)] {
            let s = shape(kh, stride, pad, format);
            let x = values(7, s.x_len().unwrap(), -1.0, 1.0);
            let w = values(8, s.w_len().unwrap(), -1.0, 1.0);
            let bn = Bn::new(s.c_out, 9);
            let eps = 1e-5;
            let f = fold(&s, &w, &bn.host(eps)).unwrap();
            let folded = conv2d(&s, &x, &f.filter).unwrap();
            let plain = reference_forward(&s, &x, &w, &bn.host(eps), None, false).unwrap();
            let (oh, ow) = s.out_hw().unwrap();
            for (i, (a, b)) in folded.iter().zip(&plain).enumerate() {
                let c = match format {
                    TensorFormat::Nhwc => i % s.c_out,
                    TensorFormat::Nchw => (i / (oh * ow)) % s.c_out,
                };
                let got = a + f.bias[c];
                assert!(
                    (got - b).abs() <= 1e-12 * (1.0 + b.abs()),
                    "{format} {kh}: {got} vs {b}"
                );
            }
            // Scale and bias by their definition.
            for c in 0..s.c_out {
                let sc = bn.gamma[c] / (bn.var[c] + eps).sqrt();
                assert!((f.scale[c] - sc).abs() <= 1e-15 * sc.abs().max(1.0));
                let b = bn.beta[c] - bn.mean[c] * sc;
                assert!((f.bias[c] - b).abs() <= 1e-15 * b.abs().max(1.0));
            }
            let z = values(10, plain.len(), -1.0, 1.0);
            let y = reference_forward(&s, &x, &w, &bn.host(eps), Some(&z), true).unwrap();
            for i in 0..y.len() {
                assert_eq!(y[i], (plain[i] + z[i]).max(0.0));
            }
            let y = reference_forward(&s, &x, &w, &bn.host(eps), None, true).unwrap();
            assert!(y.iter().zip(&plain).all(|(a, b)| *a == b.max(0.0)));
        }
    }
}

/// Every bad parameter is an error naming it.
#[test]
fn fold_names_the_bad_argument() {
    let s = shape(3, 1, 1, TensorFormat::Nhwc);
    let w = values(1, s.w_len().unwrap(), -1.0, 1.0);
    let bn = Bn::new(s.c_out, 2);
    let arg =
        |r: nnfuse::Result<nnfuse::block::Folded>| r.unwrap_err().argument().map(String::from);
    assert_eq!(arg(fold(&s, &w[1..], &bn.host(1e-5))), Some("w".into()));
    for eps in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert_eq!(arg(fold(&s, &w, &bn.host(eps))), Some("eps".into()));
    }
    let short = vec![1.0; s.c_out - 1];
    let mut h = bn.host(1e-5);
    h.gamma = &short;
    assert_eq!(arg(fold(&s, &w, &h)), Some("gamma".into()));
    let mut h = bn.host(1e-5);
    h.beta = &short;
    assert_eq!(arg(fold(&s, &w, &h)), Some("beta".into()));
    let mut h = bn.host(1e-5);
    h.running_mean = &short;
    assert_eq!(arg(fold(&s, &w, &h)), Some("running_mean".into()));
    let negative = vec![-1.0; s.c_out];
    let mut h = bn.host(1e-5);
    h.running_var = &negative;
    assert_eq!(arg(fold(&s, &w, &h)), Some("running_var".into()));
    let nan = vec![f64::NAN; s.c_out];
    let mut h = bn.host(1e-5);
    h.gamma = &nan;
    assert_eq!(arg(fold(&s, &w, &h)), Some("gamma".into()));
    let x = values(3, s.x_len().unwrap(), -1.0, 1.0);
    let z = vec![0.0; 3];
    let e = reference_forward(&s, &x, &w, &bn.host(1e-5), Some(&z), true).unwrap_err();
    assert_eq!(e.argument(), Some("shortcut"));
}

/// The GEMM route: NHWC only, cuBLASLt needed, pointwise without columns, k×k through im2col
/// under the column cap; the cuDNN route wherever cuDNN loads; the unfused one always.
#[test]
fn plan_eligibility_and_reasons() {
    let nhwc = |kh, stride, pad| shape(kh, stride, pad, TensorFormat::Nhwc);
    for dt in DType::ALL {
        let p = plan(&nhwc(1, 1, 0), dt, true, true).unwrap();
        assert!(p.eligible(BlockRoute::GemmEpilogue), "{p}");
        assert!(
            p.info(BlockRoute::GemmEpilogue)
                .reason
                .starts_with("pointwise"),
            "{p}"
        );
        assert!(p.eligible(BlockRoute::CudnnFused) && p.eligible(BlockRoute::Unfused));
        assert_eq!(
            p.fused_candidates(),
            vec![BlockRoute::GemmEpilogue, BlockRoute::CudnnFused]
        );
        for s in [nhwc(3, 1, 1), nhwc(1, 2, 0), nhwc(3, 2, 1)] {
            let p = plan(&s, dt, true, true).unwrap();
            assert!(p.eligible(BlockRoute::GemmEpilogue), "{p}");
            assert!(
                p.info(BlockRoute::GemmEpilogue).reason.contains("im2col"),
                "{p}"
            );
        }
        let p = plan(&shape(1, 1, 0, TensorFormat::Nchw), dt, true, true).unwrap();
        assert!(!p.eligible(BlockRoute::GemmEpilogue));
        assert!(
            p.info(BlockRoute::GemmEpilogue).reason.contains("NCHW"),
            "{p}"
        );
        assert_eq!(p.fused_candidates(), vec![BlockRoute::CudnnFused]);
        let p = plan(&nhwc(1, 1, 0), dt, false, false).unwrap();
        assert!(p.info(BlockRoute::GemmEpilogue).reason.contains("cuBLASLt"));
        assert!(p.info(BlockRoute::CudnnFused).reason.contains("cuDNN"));
        assert!(p.fused_candidates().is_empty());
        assert!(p.eligible(BlockRoute::Unfused));
    }
    // Columns over the cap: refused with their size.
    let mut big = nhwc(3, 1, 1);
    big.n = 64;
    big.h = 128;
    big.w = 128;
    big.c_in = 128;
    let p = plan(&big, DType::F32, true, true).unwrap();
    let cols = 64 * 128 * 128 * 128 * 9 * 4;
    assert!(cols > MAX_COLUMN_BYTES);
    assert!(!p.eligible(BlockRoute::GemmEpilogue));
    assert!(
        p.info(BlockRoute::GemmEpilogue)
            .reason
            .contains(&cols.to_string()),
        "{p}"
    );
    // An invalid shape names its field.
    let mut bad = nhwc(1, 1, 0);
    bad.c_out = 0;
    assert!(plan(&bad, DType::F16, true, true)
        .unwrap_err()
        .argument()
        .is_some());
}

#[test]
fn route_names_round_trip() {
    for r in BlockRoute::ALL {
        assert_eq!(r.name().parse::<BlockRoute>().unwrap(), r);
    }
    assert_eq!(
        "bogus".parse::<BlockRoute>().unwrap_err().argument(),
        Some("route")
    );
    assert_eq!(tolerance(DType::F32), 1e-5);
    assert_eq!(tolerance(DType::F16), 1e-2);
}

/// `demo --inference` runs alone: with the training step's extras it exits 2 naming the flag.
#[test]
fn demo_inference_runs_alone() {
    for extra in ["--graph", "--profile-host"] {
        let out = common::run_nnfuse(&["demo", "--inference", extra], &[], &[]);
        common::exits_2_naming(&out, "--inference");
    }
}
