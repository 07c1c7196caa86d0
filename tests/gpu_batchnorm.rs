//! BatchNorm on the GPU against the f64 reference, path against path, policy against policy,
//! and bad input. The cuDNN paths are pinned with `NNFUSE_BN_IMPL=cudnn` (`Config::bn_impl`);
//! the `forced_own` grids run the same grid with `bn_impl = own`, as a machine without cuDNN
//! does (tests/gpu_batchnorm_own.rs tests the own kernels in depth). Ignored without a GPU;
//! `.gpu/run` runs them.

mod common;

use common::*;
use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use nnfuse::batchnorm::{
    BackwardArgs, BatchNorm, BnMode, BnPath, BnSaved, Fuse, InferenceArgs, TrainArgs,
};
use nnfuse::internals::batchnorm::{probe_fused, Support};
use nnfuse::internals::util;
use nnfuse::reference::activation::relu_mask_fwd;
use nnfuse::reference::batchnorm::{self as rb, Activation, ActivationBackward, BnShape};
use nnfuse::{BnImpl, Config, Context, Element, TensorFormat};

/// Host copies of one case's inputs (already rounded to T, so the reference sees what the GPU
/// sees).
struct Inputs<T> {
    x: Vec<T>,
    z: Vec<T>,
    dy: Vec<T>,
    gamma: Vec<f32>,
    beta: Vec<f32>,
    rm: Vec<f32>,
    rv: Vec<f32>,
}

fn inputs<T: Element>(rng: &mut Rng, n: usize, c: usize) -> Inputs<T> {
    Inputs {
        x: rng.vec(n, -2.0, 3.0),
        z: rng.vec(n, -1.0, 1.0),
        dy: rng.vec(n, -1.0, 1.0),
        gamma: rng.vec(c, 0.5, 1.5),
        beta: rng.vec(c, -0.5, 0.5),
        rm: rng.vec(c, -0.1, 0.1),
        rv: rng.vec(c, 0.5, 1.5),
    }
}

/// Everything one GPU run produced, as f64.
#[derive(Debug)]
struct Outputs {
    path: BnPath,
    y: Vec<f64>,
    rm: Vec<f64>,
    rv: Vec<f64>,
    saved_mean: Vec<f64>,
    saved_inv_std: Vec<f64>,
    mask: Option<Vec<u32>>,
    dx: Vec<f64>,
    dz: Option<Vec<f64>>,
    dgamma: Vec<f64>,
    dbeta: Vec<f64>,
    y_inference: Vec<f64>,
}

const MOMENTUM: f64 = 0.1;
const EPS: f64 = 1e-5;

fn run_gpu<T: Element>(
    ctx: &Context,
    shape: &[usize],
    axis: usize,
    fuse: Fuse,
    inp: &Inputs<T>,
) -> Outputs {
    let s = ctx.stream();
    let n = inp.x.len();
    let c = inp.gamma.len();
    let bn = BatchNorm::<T>::new(ctx, shape, axis, fuse).unwrap();
    let x = s.clone_htod(&inp.x).unwrap();
    let z = s.clone_htod(&inp.z).unwrap();
    let dy = s.clone_htod(&inp.dy).unwrap();
    let g = s.clone_htod(&inp.gamma).unwrap();
    let b = s.clone_htod(&inp.beta).unwrap();
    let mut rm = s.clone_htod(&inp.rm).unwrap();
    let mut rv = s.clone_htod(&inp.rv).unwrap();
    let poison = |len| {
        let mut v: CudaSlice<T> = s.alloc_zeros(len).unwrap();
        util::fill(ctx, &mut v, T::from_f64(f64::NAN)).unwrap();
        v
    };
    let poison32 = |len| {
        let mut v: CudaSlice<f32> = s.alloc_zeros(len).unwrap();
        util::fill(ctx, &mut v, f32::NAN).unwrap();
        v
    };
    let mut y = poison(n);
    let add = fuse == Fuse::AddRelu;
    let saved: BnSaved = bn
        .forward_train(TrainArgs {
            x: x.as_view(),
            addend: add.then(|| z.as_view()),
            gamma: g.as_view(),
            beta: b.as_view(),
            running_mean: rm.as_view_mut(),
            running_var: rv.as_view_mut(),
            y: y.as_view_mut(),
            momentum: MOMENTUM,
            eps: EPS,
        })
        .unwrap();
    let (mut dx, mut dz, mut dg, mut db) = (poison(n), poison(n), poison32(c), poison32(c));
    bn.backward(BackwardArgs {
        x: x.as_view(),
        y: y.as_view(),
        dy: dy.as_view(),
        gamma: g.as_view(),
        beta: b.as_view(),
        saved: &saved,
        dx: dx.as_view_mut(),
        d_addend: add.then(|| dz.as_view_mut()),
        dgamma: dg.as_view_mut(),
        dbeta: db.as_view_mut(),
    })
    .unwrap();
    // Inference with the original running statistics.
    let rm0 = s.clone_htod(&inp.rm).unwrap();
    let rv0 = s.clone_htod(&inp.rv).unwrap();
    let mut yi = poison(n);
    bn.forward_inference(InferenceArgs {
        x: x.as_view(),
        addend: add.then(|| z.as_view()),
        gamma: g.as_view(),
        beta: b.as_view(),
        running_mean: rm0.as_view(),
        running_var: rv0.as_view(),
        y: yi.as_view_mut(),
        eps: EPS,
    })
    .unwrap();
    let h = |v: &CudaSlice<T>| f64s(&s.clone_dtoh(v).unwrap());
    let h32 = |v: &CudaSlice<f32>| f64s(&s.clone_dtoh(v).unwrap());
    Outputs {
        path: saved.path(),
        y: h(&y),
        rm: h32(&rm),
        rv: h32(&rv),
        saved_mean: h32(saved.saved_mean()),
        saved_inv_std: h32(saved.saved_inv_std()),
        mask: saved.mask().map(|m| s.clone_dtoh(m).unwrap()),
        dx: h(&dx),
        dz: add.then(|| h(&dz)),
        dgamma: h32(&dg),
        dbeta: h32(&db),
        y_inference: h(&yi),
    }
}

/// Checks one GPU run against the f64 reference. The activation mask of the reference backward
/// is taken from the GPU's own y (y > 0 exactly when the pre-activation was > 0), so that an
/// element whose pre-activation rounds across zero does not flip a whole gradient entry.
fn check_against_reference<T: Element>(
    what: &str,
    shape: &[usize],
    axis: usize,
    fuse: Fuse,
    inp: &Inputs<T>,
    out: &Outputs,
) {
    let tol = T::DTYPE.tolerance();
    let sh = BnShape::new(shape, axis).unwrap();
    let x = f64s(&inp.x);
    let z = f64s(&inp.z);
    let dy = f64s(&inp.dy);
    let (g, b) = (f64s(&inp.gamma), f64s(&inp.beta));
    let (rm, rv) = (f64s(&inp.rm), f64s(&inp.rv));
    let act = match fuse {
        Fuse::None => Activation::None,
        Fuse::Relu => Activation::Relu,
        Fuse::AddRelu => Activation::AddRelu(&z),
    };
    let f = rb::train_forward(&sh, &x, &g, &b, &rm, &rv, MOMENTUM, EPS, act).unwrap();
    let w = |s: &str| format!("{what}: {s}");
    assert_close(&w("y"), &out.y, &f.y, tol);
    // Statistics are computed in f32 from exactly the inputs the reference sees.
    assert_close(&w("saved_mean"), &out.saved_mean, &f.saved_mean, 1e-5);
    assert_close(
        &w("saved_inv_std"),
        &out.saved_inv_std,
        &f.saved_inv_std,
        1e-5,
    );
    assert_close(&w("running_mean"), &out.rm, &f.running_mean, 1e-5);
    assert_close(&w("running_var"), &out.rv, &f.running_var, 1e-5);
    let gpu_mask = relu_mask_fwd(&out.y).1;
    if let Some(m) = &out.mask {
        assert_eq!(m, &gpu_mask, "{what}: saved bitmask differs from (y > 0)");
    }
    let act_bwd = match fuse {
        Fuse::None => ActivationBackward::None,
        Fuse::Relu => ActivationBackward::Relu { mask: &gpu_mask },
        Fuse::AddRelu => ActivationBackward::AddRelu { mask: &gpu_mask },
    };
    let gr = rb::backward(&sh, &x, &dy, &g, &f.saved_mean, &f.saved_inv_std, act_bwd).unwrap();
    assert_close_stored(&w("dx"), T::DTYPE, &out.dx, &gr.dx, tol);
    assert_close(&w("dgamma"), &out.dgamma, &gr.dgamma, tol.max(1e-5));
    assert_close(&w("dbeta"), &out.dbeta, &gr.dbeta, tol.max(1e-5));
    if let (Some(dz), Some(want)) = (&out.dz, &gr.d_addend) {
        assert_close(&w("d_addend"), dz, want, tol);
    }
    let yi = rb::inference_forward(&sh, &x, &g, &b, &rm, &rv, EPS, act).unwrap();
    assert_close(&w("y (inference)"), &out.y_inference, &yi, tol);
}

/// Two paths on identical inputs agree: y within tolerance; the ReLU masks (y > 0) agree except
/// at a few kinks, where the pre-activation is within rounding of zero (cuDNN's fused op adds
/// the addend before rounding to T, the fallback after, so an element an ulp from zero may land
/// on either side); dx agrees within tolerance away from those kinks.
fn compare_paths(what: &str, tol: f64, sh: &BnShape, a: &Outputs, b: &Outputs) {
    assert_close(&format!("{what}: y fused vs fallback"), &a.y, &b.y, tol);
    let n = a.y.len();
    let rms = (a.y.iter().map(|v| v * v).sum::<f64>() / n as f64).sqrt();
    let flips: Vec<usize> = (0..n)
        .filter(|&i| (a.y[i] > 0.0) != (b.y[i] > 0.0))
        .collect();
    // A flip needs the pre-activation within about one rounding step of T (relative `tol`) of
    // zero: expected count ~ n * tol * density near zero (< 1), so bound it by 1 + n * tol.
    let max_flips = 1 + (n as f64 * tol) as usize;
    assert!(
        flips.len() <= max_flips,
        "{what}: the paths' ReLU masks differ at {} of {n} elements (at most {max_flips} kinks)",
        flips.len()
    );
    for &i in &flips {
        let kink = a.y[i].abs().max(b.y[i].abs());
        assert!(
            kink <= 4.0 * tol * rms,
            "{what}: masks differ at element {i} where y = {} / {} is not near zero",
            a.y[i],
            b.y[i]
        );
    }
    // A flip changes its channel's sums (dbeta, dgamma), hence dx of the whole channel (in
    // proportion 1/M): compare dx over the channels without a flip.
    let channel = |i: usize| (i / sh.inner) % sh.c;
    let flipped: Vec<usize> = flips.iter().map(|&i| channel(i)).collect();
    let away = |v: &[f64]| -> Vec<f64> {
        v.iter()
            .enumerate()
            .filter(|(i, _)| !flipped.contains(&channel(*i)))
            .map(|(_, x)| *x)
            .collect()
    };
    assert_close(
        &format!(
            "{what}: dx fused vs fallback (away from the channels of {} kinks)",
            flips.len()
        ),
        &away(&a.dx),
        &away(&b.dx),
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
            let inp = inputs::<T>(&mut rng, n, c);
            let what = format!("{:?} {shape:?} axis {axis} {fuse:?}", T::DTYPE);
            let a = run_gpu(&fused, shape, axis, fuse, &inp);
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
                let b = run_gpu(&fallback, shape, axis, fuse, &inp);
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
        let inp = inputs::<f16>(&mut rng, shape.iter().product(), 64);
        let out = run_gpu(&ctx, &shape, 3, fuse, &inp);
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
        let inp = inputs::<f32>(&mut rng, n, shape[axis]);
        let out = run_gpu(&ctx, shape, axis, Fuse::Relu, &inp);
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
