//! BatchNorm through cuDNN's graph API (`NNFUSE_CUDNN_API=graph`, `Config::cudnn_api`) on the
//! GPU: training forward (y, saved mean and inverse std, the running statistics' in-place
//! update), backward (dx, dgamma, dbeta, d_addend) and inference (which keeps the legacy call)
//! against the f64 reference, and against the legacy route within the data type's tolerance.
//! Outputs are poisoned with NaN first; inputs are fresh random per case. Ignored without a GPU.
//!
//! Which ones to watch: `graph_route_runs_nhwc_halves` asserts that the graph actually ran for
//! f16/bf16 NHWC (cuDNN's documented support); `graph_route_matches_reference_everywhere` runs
//! f32 and NCHW too and prints whether the graph or the legacy fallback ran there (the support
//! matrix for docs/CUDNN-GRAPH.md).

mod common;

use common::*;
use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use nnfuse::batchnorm::{BackwardArgs, BatchNorm, BnPath, Fuse, InferenceArgs, TrainArgs};
use nnfuse::reference::activation::relu_mask_fwd;
use nnfuse::reference::batchnorm::{self as rb, Activation, ActivationBackward, BnShape};
use nnfuse::{BnImpl, Config, Context, CudnnApi, Element};

const EPS: f64 = 1e-5;

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

#[derive(Debug)]
struct Outputs {
    path: BnPath,
    graph: bool,
    y: Vec<f64>,
    rm: Vec<f64>,
    rv: Vec<f64>,
    saved_mean: Vec<f64>,
    saved_inv_std: Vec<f64>,
    dx: Vec<f64>,
    dz: Option<Vec<f64>>,
    dgamma: Vec<f64>,
    dbeta: Vec<f64>,
    y_inference: Vec<f64>,
}

fn ctx_for(api: CudnnApi) -> Context {
    gpu_with(
        Config::default()
            .with_bn_impl(BnImpl::Cudnn)
            .with_cudnn_api(api),
    )
}

fn run<T: Element>(
    ctx: &Context,
    shape: &[usize],
    axis: usize,
    fuse: Fuse,
    inp: &Inputs<T>,
    momentum: f64,
) -> Outputs {
    let s = ctx.stream();
    let (n, c) = (inp.x.len(), inp.gamma.len());
    let bn = BatchNorm::<T>::new(ctx, shape, axis, fuse).unwrap();
    let x = upload(ctx, &inp.x);
    let z = upload(ctx, &inp.z);
    let dy = upload(ctx, &inp.dy);
    let g = upload(ctx, &inp.gamma);
    let b = upload(ctx, &inp.beta);
    let mut rm = upload(ctx, &inp.rm);
    let mut rv = upload(ctx, &inp.rv);
    let add = fuse == Fuse::AddRelu;
    let mut y = poisoned::<T>(ctx, n);
    let saved = bn
        .forward_train(TrainArgs {
            x: x.as_view(),
            addend: add.then(|| z.as_view()),
            gamma: g.as_view(),
            beta: b.as_view(),
            running_mean: rm.as_view_mut(),
            running_var: rv.as_view_mut(),
            y: y.as_view_mut(),
            momentum,
            eps: EPS,
        })
        .unwrap();
    let (mut dx, mut dz) = (poisoned::<T>(ctx, n), poisoned::<T>(ctx, n));
    let (mut dg, mut db) = (poisoned::<f32>(ctx, c), poisoned::<f32>(ctx, c));
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
    let (rm0, rv0) = (upload(ctx, &inp.rm), upload(ctx, &inp.rv));
    let mut yi = poisoned::<T>(ctx, n);
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
        graph: saved.ran_graph(),
        y: h(&y),
        rm: h32(&rm),
        rv: h32(&rv),
        saved_mean: h32(saved.saved_mean()),
        saved_inv_std: h32(saved.saved_inv_std()),
        dx: h(&dx),
        dz: add.then(|| h(&dz)),
        dgamma: h32(&dg),
        dbeta: h32(&db),
        y_inference: h(&yi),
    }
}

/// One run against the f64 reference (the ReLU mask of the reference backward is the GPU's
/// own y > 0, as in tests/gpu_batchnorm.rs).
#[allow(clippy::too_many_arguments)]
fn check<T: Element>(
    what: &str,
    shape: &[usize],
    axis: usize,
    fuse: Fuse,
    inp: &Inputs<T>,
    momentum: f64,
    out: &Outputs,
) {
    let tol = T::DTYPE.tolerance();
    let sh = BnShape::new(shape, axis).unwrap();
    let (x, z, dy) = (f64s(&inp.x), f64s(&inp.z), f64s(&inp.dy));
    let (g, b) = (f64s(&inp.gamma), f64s(&inp.beta));
    let (rm, rv) = (f64s(&inp.rm), f64s(&inp.rv));
    let act = match fuse {
        Fuse::None => Activation::None,
        Fuse::Relu => Activation::Relu,
        Fuse::AddRelu => Activation::AddRelu(&z),
    };
    let f = rb::train_forward(&sh, &x, &g, &b, &rm, &rv, momentum, EPS, act).unwrap();
    let w = |s: &str| format!("{what}: {s}");
    assert_close(&w("y"), &out.y, &f.y, tol);
    assert_close(&w("saved_mean"), &out.saved_mean, &f.saved_mean, 1e-5);
    assert_close(
        &w("saved_inv_std"),
        &out.saved_inv_std,
        &f.saved_inv_std,
        1e-5,
    );
    assert_close(&w("running_mean"), &out.rm, &f.running_mean, 1e-5);
    assert_close(&w("running_var"), &out.rv, &f.running_var, 1e-5);
    let mask = relu_mask_fwd(&out.y).1;
    let act_bwd = match fuse {
        Fuse::None => ActivationBackward::None,
        Fuse::Relu => ActivationBackward::Relu { mask: &mask },
        Fuse::AddRelu => ActivationBackward::AddRelu { mask: &mask },
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

/// Channels-last shapes (cuDNN's documented layout for its graph BatchNorm), C % 4 != 0 and
/// N = 1 included, and a channels-first one (tried; the legacy calls run if no engine finalizes).
const NHWC: &[(&[usize], usize)] = &[
    (&[4, 14, 14, 32], 3),
    (&[8, 7, 7, 64], 3),
    (&[4, 14, 14, 30], 3),
    (&[1, 8, 8, 32], 3),
    (&[2, 4, 6, 5, 16], 4),
];
const NCHW: &[(&[usize], usize)] = &[(&[4, 24, 14, 14], 1)];

/// The grid for `T` on `shapes`: graph against the reference and against the legacy route.
/// Returns how many cases ran through the graph, and how many in all.
fn grid<T: Element>(tag: &str, shapes: &[(&[usize], usize)]) -> (usize, usize) {
    let graph = ctx_for(CudnnApi::Graph);
    let legacy = ctx_for(CudnnApi::Legacy);
    let mut rng = Rng::fresh(tag);
    let (mut ran, mut all) = (0, 0);
    for &(shape, axis) in shapes {
        let n: usize = shape.iter().product();
        let c = shape[axis];
        for fuse in Fuse::ALL {
            let inp = inputs::<T>(&mut rng, n, c);
            let what = format!("{:?} {shape:?} axis {axis} {fuse:?}", T::DTYPE);
            let a = run(&graph, shape, axis, fuse, &inp, 0.1);
            println!("{what}: graph ran: {}, path {:?}", a.graph, a.path);
            // Measured on the H100 (cuDNN 9.19, 2026-11-25): NORM_FORWARD finalizes for NHWC
            // halves when the channel count is a multiple of 8 (30 channels: no engine); those
            // cases fall back to the legacy calls, checked the same way.
            let expect_graph = c % 8 == 0;
            if expect_graph {
                ran += a.graph as usize;
                all += 1;
            } else {
                println!("{what}: {} channels, graph ran: {}", shape[axis], a.graph);
            }
            // Epilogues run as nnfuse's bitmask kernels after graph BatchNorm.
            if a.graph && fuse != Fuse::None {
                assert_eq!(a.path, BnPath::Fallback, "{what}");
            }
            check(&format!("{what} [graph]"), shape, axis, fuse, &inp, 0.1, &a);
            let b = run(&legacy, shape, axis, fuse, &inp, 0.1);
            assert!(!b.graph, "{what}: legacy must not run the graph");
            check(
                &format!("{what} [legacy]"),
                shape,
                axis,
                fuse,
                &inp,
                0.1,
                &b,
            );
            // Graph and legacy on identical inputs: the statistics within f32 rounding, y and
            // (without a ReLU kink to flip) dx within the type's tolerance.
            let tol = T::DTYPE.tolerance();
            assert_close(&format!("{what}: y graph vs legacy"), &a.y, &b.y, tol);
            assert_close(
                &format!("{what}: saved_mean graph vs legacy"),
                &a.saved_mean,
                &b.saved_mean,
                1e-5,
            );
            assert_close(
                &format!("{what}: running_var graph vs legacy"),
                &a.rv,
                &b.rv,
                1e-5,
            );
            if fuse == Fuse::None {
                assert_close(&format!("{what}: dx graph vs legacy"), &a.dx, &b.dx, tol);
                assert_close(
                    &format!("{what}: dgamma graph vs legacy"),
                    &a.dgamma,
                    &b.dgamma,
                    tol.max(1e-5),
                );
            }
        }
    }
    (ran, all)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_route_runs_nhwc_halves() {
    let (ran, all) = grid::<f16>("graph_f16", NHWC);
    assert_eq!(ran, all, "f16 NHWC: the graph ran {ran} of {all} cases");
    let (ran, all) = grid::<bf16>("graph_bf16", NHWC);
    assert_eq!(ran, all, "bf16 NHWC: the graph ran {ran} of {all} cases");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_route_matches_reference_everywhere() {
    // Support beyond NHWC halves is what this finds out: whichever route ran is checked.
    let r = [
        ("f32 NHWC", grid::<f32>("graph_f32_nhwc", NHWC)),
        ("f32 NCHW", grid::<f32>("graph_f32_nchw", NCHW)),
        ("f16 NCHW", grid::<f16>("graph_f16_nchw", NCHW)),
    ];
    for (what, (ran, all)) in r {
        println!("support: {what}: graph ran {ran} of {all} cases");
    }
}

/// The by-value scalars (epsilon, momentum) are read at each execution: a second forward with
/// another momentum on the same cached plan and buffers must use it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_route_uses_each_calls_momentum() {
    let ctx = ctx_for(CudnnApi::Graph);
    let (shape, axis) = (&[8usize, 7, 7, 64][..], 3);
    let mut rng = Rng::fresh("graph_momentum");
    let n: usize = shape.iter().product();
    for momentum in [0.1, 0.5, 1.0, 0.0] {
        let inp = inputs::<f16>(&mut rng, n, 64);
        let out = run(&ctx, shape, axis, Fuse::None, &inp, momentum);
        assert!(
            out.graph,
            "momentum {momentum}: the graph must run (f16 NHWC)"
        );
        check(
            &format!("momentum {momentum}"),
            shape,
            axis,
            Fuse::None,
            &inp,
            momentum,
            &out,
        );
    }
}

/// `legacy` keeps today's routes: no training state of a legacy Context ran the graph, and the
/// plan says legacy.
#[test]
#[ignore = "needs a CUDA GPU"]
fn legacy_never_runs_the_graph() {
    let ctx = ctx_for(CudnnApi::Legacy);
    let bn = BatchNorm::<f16>::new(&ctx, &[4, 14, 14, 32], 3, Fuse::Relu).unwrap();
    assert_eq!(bn.plan().cudnn_api_used(), Some("legacy"), "{}", bn.plan());
    let mut rng = Rng::fresh("legacy_api");
    let inp = inputs::<f16>(&mut rng, 4 * 14 * 14 * 32, 32);
    let out = run(&ctx, &[4, 14, 14, 32], 3, Fuse::Relu, &inp, 0.1);
    assert!(!out.graph);
    assert_eq!(out.path, BnPath::CudnnFused);
}
