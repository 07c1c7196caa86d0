//! GPU tests of the training unit `block::ConvBnTrain` (`conv → BatchNorm(+ReLU | +Add+ReLU)`
//! forward and backward as one planned unit, docs/BLOCK-TRAINING.md): every route, forced and
//! decided, for f16, bf16, f32 NHWC and f32 NCHW, against f64 (the convolution against the f64
//! convolution, the BatchNorm and the gradients against the f64 references fed the GPU's own
//! stored intermediates), the routes against each other, the staged calls against the whole
//! one, an accumulating data gradient, and the refusals. Fresh random inputs per run (the seed
//! is printed), every output NaN-poisoned first.
//!
//! Run: `cargo test --test gpu_conv_bn_train -- --ignored --nocapture --test-threads 1`.

mod common;

use half::{bf16, f16};
use nnfuse::batchnorm::{BackwardArgs, Fuse, TrainArgs};
use nnfuse::block::{ConvBnArgs, ConvBnBackwardArgs, ConvBnTrain, TrainRoute};
use nnfuse::conv::ConvShape;
use nnfuse::cudarc::driver::CudaSlice;
use nnfuse::reference::activation::relu_mask_fwd;
use nnfuse::reference::batchnorm::{self as rb, BnShape};
use nnfuse::reference::conv::{conv2d, conv2d_backward_data, conv2d_backward_filter};
use nnfuse::{Context, Element, Error, TensorFormat};

use common::bn::{activation, activation_backward, EPS};
use common::{
    assert_close, assert_close_stored, download, f64s, gpu, max_rel, poisoned, upload, Rng,
};

/// The demo's three units scaled down (n 2, 8x8), NHWC.
fn units() -> Vec<(ConvShape, Fuse)> {
    vec![
        (
            ConvShape::square(2, 256, 8, 64, 1, TensorFormat::Nhwc),
            Fuse::Relu,
        ),
        (
            ConvShape::square(2, 64, 8, 64, 3, TensorFormat::Nhwc),
            Fuse::Relu,
        ),
        (
            ConvShape::square(2, 64, 8, 256, 1, TensorFormat::Nhwc),
            Fuse::AddRelu,
        ),
    ]
}

/// One case's host inputs (rounded to T).
struct Inputs<T> {
    x: Vec<T>,
    w: Vec<T>,
    addend: Vec<T>,
    dy: Vec<T>,
    gamma: Vec<f32>,
    beta: Vec<f32>,
    rm: Vec<f32>,
    rv: Vec<f32>,
    /// What dx holds before an accumulating backward.
    dx0: Vec<T>,
}

impl<T: Element> Inputs<T> {
    fn new(rng: &mut Rng, s: &ConvShape) -> Inputs<T> {
        let (xn, wn, yn, c) = (
            s.x_len().unwrap(),
            s.w_len().unwrap(),
            s.y_len().unwrap(),
            s.c_out,
        );
        Inputs {
            x: rng.vec(xn, -1.0, 1.5),
            w: rng.vec(wn, -0.5, 0.5),
            addend: rng.vec(yn, -1.0, 1.0),
            dy: rng.vec(yn, -1.0, 1.0),
            gamma: rng.vec(c, 0.5, 1.5),
            beta: rng.vec(c, -0.5, 0.5),
            rm: rng.vec(c, -0.1, 0.1),
            rv: rng.vec(c, 0.5, 1.5),
            dx0: rng.vec(xn, -1.0, 1.0),
        }
    }
}

/// Everything one forward + backward wrote, as f64.
struct Out {
    route: TrainRoute,
    z: Vec<f64>,
    y: Vec<f64>,
    rm: Vec<f64>,
    rv: Vec<f64>,
    dz: Vec<f64>,
    dx: Vec<f64>,
    dw: Vec<f64>,
    dgamma: Vec<f64>,
    dbeta: Vec<f64>,
    d_addend: Option<Vec<f64>>,
    /// The backward folded (dz not written: the gradients are checked through the f64 chain).
    folded: bool,
}

/// How one run calls the unit.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Call {
    /// `forward_train` (the decided route).
    Decided,
    /// `forward_train_with(route)`.
    Forced(TrainRoute),
    /// `forward_conv` then `forward_bn`, `backward_bn` then the convolution's gradients.
    Staged,
}

/// Runs the unit once on `inp` (every output poisoned; dx holds `dx0` when `accumulate`).
fn run<T: Element>(
    ctx: &Context,
    unit: &ConvBnTrain<T>,
    inp: &Inputs<T>,
    call: Call,
    accumulate: bool,
) -> nnfuse::Result<Out> {
    run_with(ctx, unit, inp, call, accumulate, None)
}

/// [`run`] with the backward's route forced (`Some(folded)`) or decided (`None`).
fn run_with<T: Element>(
    ctx: &Context,
    unit: &ConvBnTrain<T>,
    inp: &Inputs<T>,
    call: Call,
    accumulate: bool,
    bwd: Option<bool>,
) -> nnfuse::Result<Out> {
    let s = unit.plan().shape;
    let fuse = unit.plan().fuse;
    let add = fuse == Fuse::AddRelu;
    let (yn, wn, c) = (s.y_len().unwrap(), s.w_len().unwrap(), s.c_out);
    let (x, w, addend, dy) = (
        upload(ctx, &inp.x),
        upload(ctx, &inp.w),
        upload(ctx, &inp.addend),
        upload(ctx, &inp.dy),
    );
    let (g, b) = (upload(ctx, &inp.gamma), upload(ctx, &inp.beta));
    let (mut rm, mut rv) = (upload(ctx, &inp.rm), upload(ctx, &inp.rv));
    let (mut z, mut y) = (poisoned::<T>(ctx, yn), poisoned::<T>(ctx, yn));
    let saved = match call {
        Call::Staged => {
            let done = unit.forward_conv(&x.as_view(), &w.as_view(), &mut z.as_view_mut())?;
            unit.forward_bn(
                done,
                TrainArgs {
                    x: z.as_view(),
                    addend: add.then(|| addend.as_view()),
                    gamma: g.as_view(),
                    beta: b.as_view(),
                    running_mean: rm.as_view_mut(),
                    running_var: rv.as_view_mut(),
                    y: y.as_view_mut(),
                    momentum: 0.1,
                    eps: EPS,
                },
            )?
        }
        _ => {
            let args = ConvBnArgs {
                x: x.as_view(),
                w: w.as_view(),
                z: z.as_view_mut(),
                addend: add.then(|| addend.as_view()),
                gamma: g.as_view(),
                beta: b.as_view(),
                running_mean: rm.as_view_mut(),
                running_var: rv.as_view_mut(),
                y: y.as_view_mut(),
                momentum: 0.1,
                eps: EPS,
            };
            match call {
                Call::Forced(r) => unit.forward_train_with(r, args)?,
                _ => unit.forward_train(args)?,
            }
        }
    };
    let mut dz = poisoned::<T>(ctx, yn);
    let mut dx: CudaSlice<T> = if accumulate {
        upload(ctx, &inp.dx0)
    } else {
        poisoned::<T>(ctx, inp.x.len())
    };
    let mut dw = poisoned::<T>(ctx, wn);
    let (mut dg, mut db) = (poisoned::<f32>(ctx, c), poisoned::<f32>(ctx, c));
    let mut da = poisoned::<T>(ctx, yn);
    // A decided backward folds only once a previous one decided so (the deciding call writes
    // the composed result), and only on the fused route's forward state.
    let folds_here = call != Call::Staged
        && saved.route() == TrainRoute::Fused
        && unit.fold_refusal().is_none()
        && bwd.or(unit.backward_folds()).unwrap_or(false);
    if call == Call::Staged {
        unit.backward_bn(BackwardArgs {
            x: z.as_view(),
            y: y.as_view(),
            dy: dy.as_view(),
            gamma: g.as_view(),
            beta: b.as_view(),
            saved: saved.bn(),
            dx: dz.as_view_mut(),
            d_addend: add.then(|| da.as_view_mut()),
            dgamma: dg.as_view_mut(),
            dbeta: db.as_view_mut(),
        })?;
        unit.conv()
            .backward_data_into(&dz.as_view(), &w.as_view(), &mut dx, accumulate)?;
        unit.conv()
            .backward_filter(&x.as_view(), &dz.as_view(), &mut dw, false)?;
    } else {
        let args = ConvBnBackwardArgs {
            x: x.as_view(),
            w: w.as_view(),
            z: z.as_view(),
            y: y.as_view(),
            dy: dy.as_view(),
            gamma: g.as_view(),
            beta: b.as_view(),
            saved: &saved,
            dz: dz.as_view_mut(),
            dx: Some(dx.as_view_mut()),
            accumulate_dx: accumulate,
            dw: dw.as_view_mut(),
            dgamma: dg.as_view_mut(),
            dbeta: db.as_view_mut(),
            d_addend: add.then(|| da.as_view_mut()),
        };
        match bwd {
            Some(folded) => unit.backward_with(folded, args)?,
            None => unit.backward(args)?,
        }
    }
    let h = |v: &CudaSlice<T>| f64s(&download(ctx, v));
    let h32 = |v: &CudaSlice<f32>| f64s(&download(ctx, v));
    Ok(Out {
        route: saved.route(),
        z: h(&z),
        y: h(&y),
        rm: h32(&rm),
        rv: h32(&rv),
        dz: h(&dz),
        dx: h(&dx),
        dw: h(&dw),
        dgamma: h32(&dg),
        dbeta: h32(&db),
        d_addend: add.then(|| h(&da)),
        folded: folds_here,
    })
}

/// Every output of `got` against f64: z against the f64 convolution; the BatchNorm and its
/// gradients against the f64 references fed the GPU's stored z (and its y's mask); the
/// convolution's gradients against the f64 ones of the GPU's stored dz.
fn check<T: Element>(what: &str, s: &ConvShape, fuse: Fuse, inp: &Inputs<T>, got: &Out, acc: bool) {
    let dt = T::DTYPE;
    let tol = dt.tolerance();
    let w = |n: &str| format!("{what}: {n}");
    let (x, wt) = (f64s(&inp.x), f64s(&inp.w));
    let z_ref = conv2d(s, &x, &wt).unwrap();
    assert_close(&w("z"), &got.z, &z_ref, tol);
    let (oh, ow) = s.out_hw().unwrap();
    let (dims, axis) = match s.format {
        TensorFormat::Nhwc => (vec![s.n, oh, ow, s.c_out], 3),
        TensorFormat::Nchw => (vec![s.n, s.c_out, oh, ow], 1),
    };
    let sh = BnShape::new(&dims, axis).unwrap();
    let addend = f64s(&inp.addend);
    let (g, b, rm, rv) = (
        f64s(&inp.gamma),
        f64s(&inp.beta),
        f64s(&inp.rm),
        f64s(&inp.rv),
    );
    let f = rb::train_forward(
        &sh,
        &got.z,
        &g,
        &b,
        &rm,
        &rv,
        0.1,
        EPS,
        activation(fuse, &addend),
    )
    .unwrap();
    assert_close(&w("y"), &got.y, &f.y, tol);
    assert_close(&w("running_mean"), &got.rm, &f.running_mean, tol.max(1e-5));
    assert_close(&w("running_var"), &got.rv, &f.running_var, tol.max(1e-5));
    let mask = relu_mask_fwd(&got.y).1;
    let gr = rb::backward(
        &sh,
        &got.z,
        &f64s(&inp.dy),
        &g,
        &f.saved_mean,
        &f.saved_inv_std,
        activation_backward(fuse, &mask),
    )
    .unwrap();
    // Folded: no dz; the convolution's gradients are held to those of the f64 dz.
    let dz = if got.folded {
        &gr.dx
    } else {
        assert_close_stored(&w("dz"), dt, &got.dz, &gr.dx, tol);
        &got.dz
    };
    assert_close(&w("dgamma"), &got.dgamma, &gr.dgamma, tol.max(1e-5));
    assert_close(&w("dbeta"), &got.dbeta, &gr.dbeta, tol.max(1e-5));
    if let (Some(d), Some(want)) = (&got.d_addend, &gr.d_addend) {
        assert_close(&w("d_addend"), d, want, tol);
    }
    let mut dx_ref = conv2d_backward_data(s, dz, &wt).unwrap();
    if acc {
        for (r, a) in dx_ref.iter_mut().zip(f64s(&inp.dx0)) {
            *r += a;
        }
    }
    assert_close(&w("dx"), &got.dx, &dx_ref, tol);
    let dw_ref = conv2d_backward_filter(s, &x, dz).unwrap();
    assert_close(&w("dw"), &got.dw, &dw_ref, tol);
}

/// Every route forced, then decided (twice), staged and accumulating, on one unit.
fn unit_case<T: Element>(ctx: &Context, s: ConvShape, fuse: Fuse) {
    let what = format!("{} {:?} {}", T::DTYPE.name(), s, fuse.name());
    let mut rng = Rng::fresh(&what);
    let inp = Inputs::<T>::new(&mut rng, &s);
    let unit = ConvBnTrain::<T>::new(ctx, &s, fuse).unwrap();
    println!("{}", unit.plan());
    let mut outs = Vec::new();
    for r in TrainRoute::ALL {
        if !unit.plan().eligible(r) {
            let e = run(ctx, &unit, &inp, Call::Forced(r), false).err();
            match e {
                Some(Error::NotSupported(why)) => {
                    assert!(why.contains(unit.plan().reason(r)), "{what}: {why}");
                    println!("  {r}: refused: {why}");
                }
                other => panic!("{what}: forced {r} on a refused route gave {other:?}"),
            }
            continue;
        }
        let got = run(ctx, &unit, &inp, Call::Forced(r), false).unwrap();
        assert_eq!(got.route, r);
        check(&format!("{what} {r}"), &s, fuse, &inp, &got, false);
        outs.push(got);
    }
    if outs.len() == 2 && !outs.iter().any(|o| o.folded) {
        let tol = T::DTYPE.tolerance();
        assert_close(
            &format!("{what}: fused y vs unfused"),
            &outs[0].y,
            &outs[1].y,
            tol,
        );
        assert_close(
            &format!("{what}: fused dz vs unfused"),
            &outs[0].dz,
            &outs[1].dz,
            tol,
        );
    }
    assert!(unit.choice().is_none(), "{what}: forced calls decided");
    let got = run(ctx, &unit, &inp, Call::Decided, false).unwrap();
    let choice = unit.choice().expect("the first forward_train decides");
    println!("  decided: {}", choice.describe());
    for n in &choice.notes {
        println!("    {n}");
    }
    assert_eq!(
        got.route,
        TrainRoute::Unfused,
        "the first call's result is unfused"
    );
    check(&format!("{what} first call"), &s, fuse, &inp, &got, false);
    if unit.plan().eligible(TrainRoute::Fused) {
        assert!(
            choice.notes.iter().any(|n| n.starts_with("fused:")),
            "{what}: the decision says nothing of the fused route: {:?}",
            choice.notes
        );
        if choice.provisional {
            assert_eq!(choice.route, TrainRoute::Unfused);
            assert!(choice.notes.iter().any(|n| n.contains("not measured yet")));
        }
    } else {
        assert_eq!(choice.route, TrainRoute::Unfused);
        assert!(!choice.provisional && !unit.pending());
    }
    // The forced runs above compiled the fused route's kernels: nothing is left to measure
    // after at most one more call.
    unit.load_fused_kernels().unwrap();
    let again = run(ctx, &unit, &inp, Call::Decided, true).unwrap();
    let choice = unit.choice().unwrap();
    assert!(!choice.provisional && !unit.pending(), "{what}: {choice:?}");
    check(
        &format!("{what} decided, accumulating dx"),
        &s,
        fuse,
        &inp,
        &again,
        true,
    );
    let later = run(ctx, &unit, &inp, Call::Decided, false).unwrap();
    assert_eq!(
        later.route, choice.route,
        "{what}: later calls take the decision"
    );
    check(&format!("{what} decided"), &s, fuse, &inp, &later, false);
    let staged = run(ctx, &unit, &inp, Call::Staged, false).unwrap();
    assert_eq!(staged.route, choice.route);
    check(&format!("{what} staged"), &s, fuse, &inp, &staged, false);
}

fn all<T: Element>() {
    let ctx = gpu();
    for (s, fuse) in units() {
        unit_case::<T>(&ctx, s, fuse);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn conv_bn_train_f16_every_route_matches_f64() {
    all::<f16>();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn conv_bn_train_bf16_every_route_matches_f64() {
    all::<bf16>();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn conv_bn_train_f32_every_route_matches_f64() {
    all::<f32>();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn conv_bn_train_f32_nchw_matches_f64() {
    let ctx = gpu();
    for (s, fuse) in [
        (
            ConvShape::square(2, 64, 8, 64, 3, TensorFormat::Nchw),
            Fuse::Relu,
        ),
        (
            ConvShape::square(2, 64, 8, 128, 1, TensorFormat::Nchw),
            Fuse::AddRelu,
        ),
    ] {
        unit_case::<f32>(&ctx, s, fuse);
    }
}

/// The fused route's statistics in f32 where the convolution's output has a mean large against
/// its spread (x in [1, 2), w in [0, 0.1), 1x1: E[z²]/var above 100): saved mean,
/// saved inverse std and the running statistics (momentum 1: the unbiased batch variance) within
/// 1e-6 of f64 statistics of the stored z, the unit's sums carrying their low words.
#[test]
#[ignore = "needs a CUDA GPU"]
fn conv_bn_train_f32_fused_statistics_hold_1e6_where_the_mean_is_large() {
    let ctx = gpu();
    for s in [
        // 1x1: a 3x3's zero padding spreads the border pixels' sums and shrinks E[z²]/var.
        ConvShape::square(4, 64, 8, 64, 1, TensorFormat::Nhwc),
        ConvShape::square(2, 64, 14, 256, 1, TensorFormat::Nhwc),
    ] {
        let what = format!("f32 {s:?} large mean");
        let mut rng = Rng::fresh(&what);
        let mut inp = Inputs::<f32>::new(&mut rng, &s);
        inp.x = rng.vec(inp.x.len(), 1.0, 2.0);
        inp.w = rng.vec(inp.w.len(), 0.0, 0.1);
        let unit = ConvBnTrain::<f32>::new(&ctx, &s, Fuse::Relu).unwrap();
        assert!(
            unit.plan().eligible(TrainRoute::Fused),
            "{what}: {}",
            unit.plan()
        );
        let c = s.c_out;
        let (x, w) = (upload(&ctx, &inp.x), upload(&ctx, &inp.w));
        let (g, b) = (upload(&ctx, &inp.gamma), upload(&ctx, &inp.beta));
        let (mut rm, mut rv) = (upload(&ctx, &inp.rm), upload(&ctx, &inp.rv));
        let yn = s.y_len().unwrap();
        let (mut z, mut y) = (poisoned::<f32>(&ctx, yn), poisoned::<f32>(&ctx, yn));
        let saved = unit
            .forward_train_with(
                TrainRoute::Fused,
                ConvBnArgs {
                    x: x.as_view(),
                    w: w.as_view(),
                    z: z.as_view_mut(),
                    addend: None,
                    gamma: g.as_view(),
                    beta: b.as_view(),
                    running_mean: rm.as_view_mut(),
                    running_var: rv.as_view_mut(),
                    y: y.as_view_mut(),
                    momentum: 1.0,
                    eps: EPS,
                },
            )
            .unwrap();
        assert_eq!(saved.route(), TrainRoute::Fused, "{what}");
        let zh = f64s(&download(&ctx, &z));
        let m = (yn / c) as f64;
        let (mut mean, mut var) = (vec![0.0f64; c], vec![0.0f64; c]);
        for (i, v) in zh.iter().enumerate() {
            mean[i % c] += v / m;
        }
        for (i, v) in zh.iter().enumerate() {
            var[i % c] += (v - mean[i % c]).powi(2) / m;
        }
        let ratio = (0..c)
            .map(|k| (mean[k] * mean[k] + var[k]) / var[k])
            .fold(f64::INFINITY, f64::min);
        let inv_std: Vec<f64> = var.iter().map(|v| 1.0 / (v + EPS).sqrt()).collect();
        let unbiased: Vec<f64> = var.iter().map(|v| v * m / (m - 1.0)).collect();
        let errs = [
            (
                "saved_mean",
                max_rel(&f64s(&download(&ctx, saved.bn().saved_mean())), &mean),
            ),
            (
                "saved_inv_std",
                max_rel(&f64s(&download(&ctx, saved.bn().saved_inv_std())), &inv_std),
            ),
            ("running_mean", max_rel(&f64s(&download(&ctx, &rm)), &mean)),
            (
                "running_var",
                max_rel(&f64s(&download(&ctx, &rv)), &unbiased),
            ),
        ];
        println!("{what}: E[z²]/var at least {ratio:.0}; max relative errors {errs:?}");
        assert!(
            ratio > 100.0,
            "{what}: the data's mean is not large ({ratio:.0})"
        );
        for (name, e) in errs {
            assert!(e <= 1e-6, "{what}: {name} {e:.2e} > 1e-6 of f64");
        }
    }
}

/// A receipt of another unit, and a missing addend, are errors naming the argument.
#[test]
#[ignore = "needs a CUDA GPU"]
fn conv_bn_train_names_bad_arguments() {
    let ctx = gpu();
    let s = ConvShape::square(2, 64, 8, 64, 3, TensorFormat::Nhwc);
    let a = ConvBnTrain::<f16>::new(&ctx, &s, Fuse::Relu).unwrap();
    let b = ConvBnTrain::<f16>::new(&ctx, &s, Fuse::Relu).unwrap();
    let mut rng = Rng::fresh("bad");
    let inp = Inputs::<f16>::new(&mut rng, &s);
    let (x, w) = (upload(&ctx, &inp.x), upload(&ctx, &inp.w));
    let yn = s.y_len().unwrap();
    let (mut z, mut y) = (poisoned::<f16>(&ctx, yn), poisoned::<f16>(&ctx, yn));
    let (g, bt) = (upload(&ctx, &inp.gamma), upload(&ctx, &inp.beta));
    let (mut rm, mut rv) = (upload(&ctx, &inp.rm), upload(&ctx, &inp.rv));
    let done = a
        .forward_conv(&x.as_view(), &w.as_view(), &mut z.as_view_mut())
        .unwrap();
    let e = b
        .forward_bn(
            done,
            TrainArgs {
                x: z.as_view(),
                addend: None,
                gamma: g.as_view(),
                beta: bt.as_view(),
                running_mean: rm.as_view_mut(),
                running_var: rv.as_view_mut(),
                y: y.as_view_mut(),
                momentum: 0.1,
                eps: EPS,
            },
        )
        .unwrap_err();
    assert_eq!(e.argument(), Some("done"), "{e}");
    let add = ConvBnTrain::<f16>::new(&ctx, &s, Fuse::AddRelu).unwrap();
    let e = add
        .forward_train(ConvBnArgs {
            x: x.as_view(),
            w: w.as_view(),
            z: z.as_view_mut(),
            addend: None,
            gamma: g.as_view(),
            beta: bt.as_view(),
            running_mean: rm.as_view_mut(),
            running_var: rv.as_view_mut(),
            y: y.as_view_mut(),
            momentum: 0.1,
            eps: EPS,
        })
        .unwrap_err();
    assert_eq!(e.argument(), Some("addend"), "{e}");
    assert!(add.choice().is_none(), "a refused call decided nothing");
}

/// The folded backward (a pointwise BN + add + ReLU unit: dz never written) against the
/// composed one and against f64, overwriting and accumulating dx, at a size whose sums span
/// many rows; and the decided backward's record.
fn folded_case<T: Element>(ctx: &Context, s: ConvShape, products: &str) {
    let what = format!("{} folded {:?}", T::DTYPE.name(), s);
    let mut rng = Rng::fresh(&what);
    let inp = Inputs::<T>::new(&mut rng, &s);
    let unit = ConvBnTrain::<T>::new(ctx, &s, Fuse::AddRelu).unwrap();
    assert_eq!(unit.fold_refusal(), None, "{what}");
    assert_eq!(unit.fold_products(), Some(products), "{what}");
    let fused = Call::Forced(TrainRoute::Fused);
    let tol = T::DTYPE.tolerance();
    for acc in [false, true] {
        let composed = run_with(ctx, &unit, &inp, fused, acc, Some(false)).unwrap();
        let folded = run_with(ctx, &unit, &inp, fused, acc, Some(true)).unwrap();
        assert!(folded.folded && !composed.folded);
        check(
            &format!("{what} composed acc {acc}"),
            &s,
            Fuse::AddRelu,
            &inp,
            &composed,
            acc,
        );
        check(
            &format!("{what} folded acc {acc}"),
            &s,
            Fuse::AddRelu,
            &inp,
            &folded,
            acc,
        );
        for (n, a, b) in [
            ("dx", &folded.dx, &composed.dx),
            ("dw", &folded.dw, &composed.dw),
            ("dgamma", &folded.dgamma, &composed.dgamma),
            ("dbeta", &folded.dbeta, &composed.dbeta),
        ] {
            assert_close(&format!("{what}: folded {n} vs composed"), a, b, tol);
        }
        // Two forwards: the ReLU mask may differ where the fused route's sums (cuDNN's
        // GEN_STATS, not in a fixed order) move y across 0; each d_addend is also checked
        // against f64 above.
        if let (Some(f), Some(c)) = (&folded.d_addend, &composed.d_addend) {
            assert_close(&format!("{what}: folded d_addend vs composed"), f, c, tol);
        }
        assert!(
            folded.dz.iter().all(|v| v.is_nan()),
            "{what}: dz was written"
        );
    }
    assert!(
        unit.backward_folds().is_none(),
        "{what}: forced calls decided"
    );
    // The first decided backward runs composed into the caller's buffers and decides.
    let first = run(ctx, &unit, &inp, fused, false).unwrap();
    assert!(!first.folded);
    check(
        &format!("{what} deciding"),
        &s,
        Fuse::AddRelu,
        &inp,
        &first,
        false,
    );
    let folds = unit.backward_folds().expect("the first backward decides");
    let text = unit.backward_decision();
    println!("  {text}");
    assert!(text.contains("folded: "), "{what}: {text}");
    let later = run(ctx, &unit, &inp, fused, false).unwrap();
    assert_eq!(later.folded, folds);
    check(
        &format!("{what} decided"),
        &s,
        Fuse::AddRelu,
        &inp,
        &later,
        false,
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn conv_bn_train_folded_backward_matches_composed_and_f64() {
    let ctx = gpu();
    // G and H in the sums pass (tensor cores) for the halves: 784 rows (a partial tile), two
    // slabs of output channels; four slabs at 392 rows.
    let s = ConvShape::square(4, 64, 14, 256, 1, TensorFormat::Nhwc);
    let tc = "sums pass (tensor cores)";
    folded_case::<f16>(&ctx, s, tc);
    folded_case::<bf16>(&ctx, s, tc);
    folded_case::<f32>(&ctx, s, "cuBLAS");
    let s4 = ConvShape::square(2, 64, 14, 512, 1, TensorFormat::Nhwc);
    folded_case::<f16>(&ctx, s4, tc);
    folded_case::<bf16>(&ctx, s4, tc);
    // Sixteen slabs: H's tiles two a slab.
    let s16 = ConvShape::square(2, 64, 8, 2048, 1, TensorFormat::Nhwc);
    folded_case::<f16>(&ctx, s16, tc);
    // cuBLAS's products for the halves: 32 input channels.
    let s32 = ConvShape::square(4, 32, 14, 128, 1, TensorFormat::Nhwc);
    folded_case::<f16>(&ctx, s32, "cuBLAS");
    folded_case::<bf16>(&ctx, s32, "cuBLAS");
}

/// The fold refused with its reason: a 3x3 unit, and a forward state of the unfused route.
#[test]
#[ignore = "needs a CUDA GPU"]
fn conv_bn_train_folded_backward_refusals_say_why() {
    let ctx = gpu();
    let s3 = ConvShape::square(2, 64, 8, 64, 3, TensorFormat::Nhwc);
    let unit = ConvBnTrain::<f16>::new(&ctx, &s3, Fuse::AddRelu).unwrap();
    let why = unit
        .fold_refusal()
        .expect("a 3x3 unit does not fold")
        .to_string();
    assert!(why.contains("1x1"), "{why}");
    let mut rng = Rng::fresh("fold refusals");
    let inp = Inputs::<f16>::new(&mut rng, &s3);
    match run_with(
        &ctx,
        &unit,
        &inp,
        Call::Forced(TrainRoute::Fused),
        false,
        Some(true),
    ) {
        Err(Error::NotSupported(m)) => assert!(m.contains("1x1"), "{m}"),
        other => panic!("a 3x3 fold gave {:?}", other.map(|o| o.folded)),
    }
    let s1 = ConvShape::square(2, 64, 8, 256, 1, TensorFormat::Nhwc);
    let unit = ConvBnTrain::<f16>::new(&ctx, &s1, Fuse::AddRelu).unwrap();
    let inp = Inputs::<f16>::new(&mut rng, &s1);
    match run_with(
        &ctx,
        &unit,
        &inp,
        Call::Forced(TrainRoute::Unfused),
        false,
        Some(true),
    ) {
        Err(Error::NotSupported(m)) => assert!(m.contains("unfused"), "{m}"),
        other => panic!(
            "a fold of an unfused forward gave {:?}",
            other.map(|o| o.folded)
        ),
    }
    // The unfused forward's backward stays composed, undecided.
    let got = run(&ctx, &unit, &inp, Call::Forced(TrainRoute::Unfused), false).unwrap();
    assert!(!got.folded && unit.backward_folds().is_none());
    check("f16 unfused forward", &s1, Fuse::AddRelu, &inp, &got, false);
}
