//! BatchNorm on the GPU against the f64 reference, path against path, policy against policy,
//! and bad input. The cuDNN paths are pinned with `NNFUSE_BN_IMPL=cudnn` (`Config::bn_impl`);
//! the `forced_own` grids run the same grid with `bn_impl = own`, as a machine without cuDNN
//! does (tests/gpu_batchnorm_own.rs tests the own kernels in depth). Ignored without a GPU;
//! `.gpu/run` runs them.

mod common;

use common::bn::{self, dx_away_from_kinks, Inputs, Outputs, Run};
use common::*;
use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use nnfuse::batchnorm::{BackwardArgs, BatchNorm, BnMode, BnPath, BnSaved, Fuse, TrainArgs};
use nnfuse::internals::batchnorm::{probe_fused, Support};
use nnfuse::internals::util;
use nnfuse::reference::activation::relu_mask_fwd;
use nnfuse::reference::batchnorm::BnShape;
use nnfuse::{BnImpl, Config, Context, Element, TensorFormat};

const MOMENTUM: f64 = 0.1;

/// [`bn::check_against_reference`] at [`MOMENTUM`], and a saved bitmask equal to (y > 0).
fn check_against_reference<T: Element>(
    what: &str,
    shape: &[usize],
    axis: usize,
    fuse: Fuse,
    inp: &Inputs<T>,
    out: &Outputs,
) {
    if let Some(m) = &out.mask {
        assert_eq!(
            m,
            &relu_mask_fwd(&out.y).1,
            "{what}: saved bitmask differs from (y > 0)"
        );
    }
    bn::check_against_reference(what, shape, axis, fuse, inp, MOMENTUM, out);
}

/// Two paths on identical inputs agree: y within tolerance; the ReLU masks (y > 0) agree except
/// at a few kinks; dx agrees within tolerance away from those kinks ([`dx_away_from_kinks`]).
fn compare_paths(what: &str, tol: f64, sh: &BnShape, a: &Outputs, b: &Outputs) {
    assert_close(&format!("{what}: y fused vs fallback"), &a.y, &b.y, tol);
    let (a_dx, b_dx, kinks) = dx_away_from_kinks(what, tol, sh, a, b);
    assert_close(
        &format!("{what}: dx fused vs fallback (away from the channels of {kinks} kinks)"),
        &a_dx,
        &b_dx,
        tol,
    );
}

/// Shapes of the grid: 2-D to 5-D, channels first and last, axis other than 1, C % 4 != 0,
/// N = 1, H = W = 1.
const SHAPES: &[(&[usize], usize)] = &[
    (&[256, 64], 1),        // 2-D
    (&[8, 12, 50], 1),      // 3-D channels-first
    (&[4, 24, 14, 14], 1),  // 4-D channels-first
    (&[4, 14, 14, 32], 3),  // 4-D channels-last
    (&[4, 14, 14, 30], 3),  // channels-last, C % 4 != 0
    (&[1, 8, 8, 32], 3),    // N = 1
    (&[16, 32, 1, 1], 1),   // H = W = 1 (infers NHWC)
    (&[2, 8, 4, 6, 5], 1),  // 5-D channels-first
    (&[2, 4, 6, 5, 16], 4), // 5-D channels-last
    (&[3, 5, 12, 7], 2),    // axis in the middle
    (&[6, 20], 0),          // axis 0 of a 2-D tensor
];

/// A Context that runs BatchNorm on cuDNN (fused where cuDNN allows it).
fn cudnn_ctx() -> Context {
    gpu_with(Config::default().with_bn_impl(BnImpl::Cudnn))
}

/// The grid on cuDNN (fused and forced fallback, compared), or with `own` on nnfuse's own
/// kernels (as without cuDNN), compared with cuDNN's fallback.
fn grid_for<T: Element>(tag: &str, own: bool) {
    let fused = if own {
        gpu_with(Config::default().with_bn_impl(BnImpl::Own))
    } else {
        cudnn_ctx()
    };
    let fallback = gpu_with(
        Config::default()
            .with_bn_impl(BnImpl::Cudnn)
            .with_cudnn_fusion_disabled(true),
    );
    let mut rng = Rng::fresh(tag);
    for &(shape, axis) in SHAPES {
        let n: usize = shape.iter().product();
        let c = shape[axis];
        for fuse in [Fuse::None, Fuse::Relu, Fuse::AddRelu] {
            let inp = Inputs::<T>::uniform(&mut rng, n, c);
            let what = format!("{:?} {shape:?} axis {axis} {fuse:?}", T::DTYPE);
            let a = bn::run(&fused, shape, axis, Run::plain(fuse, MOMENTUM), &inp);
            if own {
                assert_eq!(a.path, BnPath::Own, "{what}: bn_impl = own");
            }
            check_against_reference(
                &format!("{what} [{:?}]", a.path),
                shape,
                axis,
                fuse,
                &inp,
                &a,
            );
            if fuse != Fuse::None || own {
                let b = bn::run(&fallback, shape, axis, Run::plain(fuse, MOMENTUM), &inp);
                let want = if fuse == Fuse::None {
                    BnPath::Plain
                } else {
                    BnPath::Fallback
                };
                assert_eq!(b.path, want, "{what}: fusion disabled by config");
                check_against_reference(
                    &format!("{what} [forced fallback]"),
                    shape,
                    axis,
                    fuse,
                    &inp,
                    &b,
                );
                let sh = BnShape::new(shape, axis).unwrap();
                compare_paths(&what, T::DTYPE.tolerance(), &sh, &a, &b);
            }
            println!("ok {what}: path {:?}", a.path);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn grid_f32() {
    grid_for::<f32>("bn f32", false);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn grid_f16() {
    grid_for::<f16>("bn f16", false);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn grid_bf16() {
    grid_for::<bf16>("bn bf16", false);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn grid_forced_own_f32() {
    grid_for::<f32>("bn own f32", true);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn grid_forced_own_f16() {
    grid_for::<f16>("bn own f16", true);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn grid_forced_own_bf16() {
    grid_for::<bf16>("bn own bf16", true);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn channels_last_f16_takes_the_fused_path() {
    let ctx = cudnn_ctx();
    let mut rng = Rng::fresh("fused");
    for fuse in [Fuse::Relu, Fuse::AddRelu] {
        let shape = [8, 28, 28, 64];
        let inp = Inputs::<f16>::uniform(&mut rng, shape.iter().product(), 64);
        let out = bn::run(&ctx, &shape, 3, Run::plain(fuse, MOMENTUM), &inp);
        assert_eq!(out.path, BnPath::CudnnFused, "{fuse:?}");
        check_against_reference("fused", &shape, 3, fuse, &inp, &out);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn policies_and_env_flags_choose_the_mode_and_agree() {
    let vars = |pairs: &[(&str, &str)]| {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(move |k| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
            .unwrap()
    };
    let nchw: (&[usize], usize) = (&[4, 24, 14, 14], 1);
    let nhwc: (&[usize], usize) = (&[4, 14, 14, 32], 3);
    let two_d: (&[usize], usize) = (&[256, 64], 1);
    use BnMode::*;
    // (env, shape, expected training mode)
    type Case<'a> = (Vec<(&'a str, &'a str)>, (&'a [usize], usize), BnMode);
    let cases: Vec<Case> = vec![
        (vec![], nchw, Spatial),
        (vec![("NNFUSE_ENABLE_NHWC", "1")], nchw, SpatialPersistent),
        (
            vec![("ONEFLOW_ENABLE_NHWC", "true")],
            nchw,
            SpatialPersistent,
        ),
        (vec![], nhwc, SpatialPersistent),
        (vec![("NNFUSE_BN_MODE_POLICY", "oneflow")], nhwc, Spatial),
        (
            vec![
                ("NNFUSE_BN_MODE_POLICY", "oneflow"),
                ("ONEFLOW_ENABLE_NHWC", "1"),
            ],
            nhwc,
            SpatialPersistent,
        ),
        (
            vec![("NNFUSE_BN_MODE_POLICY", "oneflow")],
            two_d,
            PerActivation,
        ),
        (vec![], two_d, SpatialPersistent),
        (
            vec![("NNFUSE_BN_MODE_POLICY", "fast")],
            nchw,
            SpatialPersistent,
        ),
    ];
    let mut rng = Rng::fresh("policies");
    for (env, (shape, axis), mode) in cases {
        let ctx = gpu_with(vars(&env));
        let bn = BatchNorm::<f32>::new(&ctx, shape, axis, Fuse::Relu).unwrap();
        assert_eq!(bn.plan().mode, mode, "{env:?} {shape:?}");
        let n: usize = shape.iter().product();
        let inp = Inputs::<f32>::uniform(&mut rng, n, shape[axis]);
        let out = bn::run(&ctx, shape, axis, Run::plain(Fuse::Relu, MOMENTUM), &inp);
        // Every policy's path agrees with the reference (hence with every other policy).
        check_against_reference(
            &format!("{env:?} {shape:?} {mode:?}"),
            shape,
            axis,
            Fuse::Relu,
            &inp,
            &out,
        );
    }
}

/// The support matrix of cuDNN's fused BatchNorm recorded in docs/CUDNN-FACTS.md and docs/ARCHITECTURE.md (measured on
/// cuDNN 9.14 and 9.19). A new cuDNN that changes it fails here, so the plan's rules get
/// revisited.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cudnn_fused_support_matrix_is_as_recorded() {
    use Support::*;
    let ctx = gpu();
    let dims32 = (16, 32, 56, 56);
    let dims30 = (16, 30, 56, 56);
    let nhwc = TensorFormat::Nhwc;
    let nchw = TensorFormat::Nchw;
    let p = BnMode::SpatialPersistent;
    let sp = BnMode::Spatial;
    let cases = [
        (nhwc, dims32, sp, Fuse::None, Works),
        (nhwc, dims32, p, Fuse::None, Works),
        (nhwc, dims32, sp, Fuse::Relu, ForwardRefused),
        (nhwc, dims32, p, Fuse::Relu, Works),
        (nhwc, dims30, p, Fuse::Relu, Works),
        (nhwc, dims32, sp, Fuse::AddRelu, ForwardRefused),
        (nhwc, dims32, p, Fuse::AddRelu, Works),
        (nhwc, dims30, p, Fuse::AddRelu, QueryRefused),
        (nchw, dims32, sp, Fuse::None, Works),
        (nchw, dims32, p, Fuse::None, Works),
    ];
    for dtype in nnfuse::DType::ALL {
        for (format, dims, mode, fuse, want) in cases {
            let got = probe_fused(&ctx, format, dims, dtype, mode, fuse).unwrap();
            assert_eq!(got, want, "{dtype} {format} {dims:?} {mode:?} {fuse:?}");
        }
        for mode in [sp, p] {
            for fuse in [Fuse::Relu, Fuse::AddRelu] {
                let got = probe_fused(&ctx, nchw, dims32, dtype, mode, fuse).unwrap();
                assert_ne!(
                    got, Works,
                    "{dtype} NCHW {mode:?} {fuse:?} is now supported"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_input_is_an_error_naming_the_argument_and_launches_nothing() {
    for bn_impl in [BnImpl::Cudnn, BnImpl::Own] {
        bad_input_with(gpu_with(Config::default().with_bn_impl(bn_impl)));
    }
}

fn bad_input_with(ctx: Context) {
    let s = ctx.stream();
    let shape = [4, 8, 8, 16];
    let n: usize = shape.iter().product();
    let bn = BatchNorm::<f32>::new(&ctx, &shape, 3, Fuse::AddRelu).unwrap();
    let mut rng = Rng::fresh("bad");
    let x = s.clone_htod(&rng.vec::<f32>(n, -1.0, 1.0)).unwrap();
    let z = s.clone_htod(&rng.vec::<f32>(n, -1.0, 1.0)).unwrap();
    let g = s.clone_htod(&[1.0f32; 16]).unwrap();
    let g_short = s.clone_htod(&[1.0f32; 15]).unwrap();
    let b = s.alloc_zeros::<f32>(16).unwrap();
    let mut rm = s.alloc_zeros::<f32>(16).unwrap();
    let mut rv = s.clone_htod(&[1.0f32; 16]).unwrap();
    let mut y = s.alloc_zeros::<f32>(n).unwrap();
    util::fill(&ctx, &mut y, -7.0).unwrap();
    let x_short = s.clone_htod(&rng.vec::<f32>(n - 1, -1.0, 1.0)).unwrap();

    macro_rules! train {
        ($x:expr, $z:expr, $g:expr, $y:expr, $mom:expr, $eps:expr) => {
            bn.forward_train(TrainArgs {
                x: $x,
                addend: $z,
                gamma: $g,
                beta: b.as_view(),
                running_mean: rm.as_view_mut(),
                running_var: rv.as_view_mut(),
                y: $y,
                momentum: $mom,
                eps: $eps,
            })
        };
    }
    let arg = |r: nnfuse::Result<BnSaved>| r.unwrap_err().argument().map(str::to_string);
    assert_eq!(
        arg(train!(
            x.as_view(),
            Some(z.as_view()),
            g_short.as_view(),
            y.as_view_mut(),
            0.1,
            1e-5
        ))
        .as_deref(),
        Some("gamma")
    );
    assert_eq!(
        arg(train!(
            x_short.as_view(),
            Some(z.as_view()),
            g.as_view(),
            y.as_view_mut(),
            0.1,
            1e-5
        ))
        .as_deref(),
        Some("x")
    );
    assert_eq!(
        arg(train!(
            x.as_view(),
            None,
            g.as_view(),
            y.as_view_mut(),
            0.1,
            1e-5
        ))
        .as_deref(),
        Some("addend")
    );
    assert_eq!(
        arg(train!(
            x.as_view(),
            Some(z.as_view()),
            g.as_view(),
            y.as_view_mut(),
            0.1,
            0.0
        ))
        .as_deref(),
        Some("eps")
    );
    assert_eq!(
        arg(train!(
            x.as_view(),
            Some(z.as_view()),
            g.as_view(),
            y.as_view_mut(),
            1.5,
            1e-5
        ))
        .as_deref(),
        Some("momentum")
    );
    // y aliasing x: a second handle on x's memory (only unsafe code can make one).
    {
        let (xp, _g) = cudarc::driver::DevicePtr::device_ptr(&x, s);
        let mut alias: CudaSlice<f32> = unsafe { s.upgrade_device_ptr(xp, n) };
        let r = train!(
            x.as_view(),
            Some(z.as_view()),
            g.as_view(),
            alias.as_view_mut(),
            0.1,
            1e-5
        );
        alias.leak();
        assert_eq!(arg(r).as_deref(), Some("y"));
    }
    // Nothing ran: y still holds its fill, the running statistics are untouched.
    assert!(s.clone_dtoh(&y).unwrap().iter().all(|&v| v == -7.0));
    assert!(s.clone_dtoh(&rm).unwrap().iter().all(|&v| v == 0.0));

    // Zero-size dims and bad axes fail at construction.
    let e = BatchNorm::<f32>::new(&ctx, &[4, 0, 8], 1, Fuse::None).unwrap_err();
    assert_eq!(e.argument(), Some("shape[1]"));
    let e = BatchNorm::<f32>::new(&ctx, &[4, 8], 2, Fuse::None).unwrap_err();
    assert_eq!(e.argument(), Some("axis"));
    // Training with one value per channel.
    let one = BatchNorm::<f32>::new(&ctx, &[1, 16], 1, Fuse::None).unwrap();
    let x1 = s.alloc_zeros::<f32>(16).unwrap();
    let mut y1 = s.alloc_zeros::<f32>(16).unwrap();
    let e = one
        .forward_train(TrainArgs {
            x: x1.as_view(),
            addend: None,
            gamma: g.as_view(),
            beta: b.as_view(),
            running_mean: rm.as_view_mut(),
            running_var: rv.as_view_mut(),
            y: y1.as_view_mut(),
            momentum: 0.1,
            eps: 1e-5,
        })
        .unwrap_err();
    assert_eq!(e.argument(), Some("shape"));

    // A backward given another forward's state.
    let saved = train!(
        x.as_view(),
        Some(z.as_view()),
        g.as_view(),
        y.as_view_mut(),
        0.1,
        1e-5
    )
    .unwrap();
    let other = BatchNorm::<f32>::new(&ctx, &shape, 3, Fuse::Relu).unwrap();
    let mut dx = s.alloc_zeros::<f32>(n).unwrap();
    let mut dz = s.alloc_zeros::<f32>(n).unwrap();
    let mut dg = s.alloc_zeros::<f32>(16).unwrap();
    let mut db = s.alloc_zeros::<f32>(16).unwrap();
    let e = other
        .backward(BackwardArgs {
            x: x.as_view(),
            y: y.as_view(),
            dy: z.as_view(),
            gamma: g.as_view(),
            beta: b.as_view(),
            saved: &saved,
            dx: dx.as_view_mut(),
            d_addend: None,
            dgamma: dg.as_view_mut(),
            dbeta: db.as_view_mut(),
        })
        .unwrap_err();
    assert_eq!(e.argument(), Some("saved"));
    // The right BatchNorm, but another x.
    let e = bn
        .backward(BackwardArgs {
            x: z.as_view(),
            y: y.as_view(),
            dy: x.as_view(),
            gamma: g.as_view(),
            beta: b.as_view(),
            saved: &saved,
            dx: dx.as_view_mut(),
            d_addend: Some(dz.as_view_mut()),
            dgamma: dg.as_view_mut(),
            dbeta: db.as_view_mut(),
        })
        .unwrap_err();
    assert_eq!(e.argument(), Some("x"));
    // d_addend missing for Add+ReLU.
    let e = bn
        .backward(BackwardArgs {
            x: x.as_view(),
            y: y.as_view(),
            dy: z.as_view(),
            gamma: g.as_view(),
            beta: b.as_view(),
            saved: &saved,
            dx: dx.as_view_mut(),
            d_addend: None,
            dgamma: dg.as_view_mut(),
            dbeta: db.as_view_mut(),
        })
        .unwrap_err();
    assert_eq!(e.argument(), Some("d_addend"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn repeated_shape_reuses_the_plan() {
    let ctx = gpu();
    let a = BatchNorm::<f16>::new(&ctx, &[8, 7, 7, 64], 3, Fuse::AddRelu).unwrap();
    let t = std::time::Instant::now();
    let iters = 10_000;
    for _ in 0..iters {
        let b = BatchNorm::<f16>::new(&ctx, &[8, 7, 7, 64], 3, Fuse::AddRelu).unwrap();
        assert_eq!(b.plan(), a.plan());
    }
    // Reported, not asserted (timing belongs in benches): the cached lookup per call.
    println!(
        "BatchNorm::new on a repeated shape: {:.2} us",
        t.elapsed().as_secs_f64() * 1e6 / iters as f64
    );
}
