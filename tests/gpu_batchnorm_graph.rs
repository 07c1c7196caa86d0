//! BatchNorm through cuDNN's graph API (`NNFUSE_CUDNN_API=graph`, `Config::cudnn_api`) on the
//! GPU: training forward (y, saved mean and inverse std, the running statistics' in-place
//! update), backward (dx, dgamma, dbeta, d_addend) and inference (NORM_FORWARD's inference
//! phase after nnfuse's inv_std kernel), with the ReLU / Add+ReLU epilogue inside the graph,
//! against the f64 reference, and against the legacy route within the data type's tolerance.
//! Outputs are poisoned with NaN first; inputs are fresh random per case. Ignored without a GPU.
//!
//! Which ones to watch: `graph_route_runs_nhwc_halves` asserts that the graph actually ran for
//! f16/bf16 NHWC (cuDNN's documented support); `graph_epilogue_runs_nhwc_halves` that the
//! forward and backward epilogue graphs build there and that the forward kept no mask;
//! `graph_inference_runs_nhwc_halves` that the inference plan builds there;
//! `graph_route_matches_reference_everywhere` runs f32 and NCHW too and prints which route ran
//! (the support matrix for docs/CUDNN-GRAPH.md).

mod common;

use common::bn::{self, check_against_reference, dx_away_from_kinks, Inputs, Run};
use common::*;
use half::{bf16, f16};
use nnfuse::batchnorm::{BatchNorm, BnPath, Fuse};
use nnfuse::internals::cudnn_graph::{BnDirection, BnEpilogue, GraphBn, GraphBnKey, GraphPolicy};
use nnfuse::reference::batchnorm::BnShape;
use nnfuse::{BnImpl, Config, Context, CudnnApi, DType, Element};

fn ctx_for(api: CudnnApi) -> Context {
    gpu_with(
        Config::default()
            .with_bn_impl(BnImpl::Cudnn)
            .with_cudnn_api(api),
    )
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
            let inp = Inputs::<T>::uniform(&mut rng, n, c);
            let what = format!("{:?} {shape:?} axis {axis} {fuse:?}", T::DTYPE);
            let a = bn::run(&graph, shape, axis, Run::plain(fuse, 0.1), &inp);
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
            // The epilogue graph keeps no mask (its backward reads y); where cuDNN does not
            // build it, graph BatchNorm + nnfuse's bitmask kernels (the fallback, with a mask).
            if a.graph && fuse != Fuse::None {
                match a.path {
                    BnPath::CudnnFused => assert!(a.mask.is_none(), "{what}"),
                    BnPath::Fallback => assert!(a.mask.is_some(), "{what}"),
                    p => panic!("{what}: path {p:?} after a graph forward with an activation"),
                }
                println!(
                    "{what}: epilogue in the graph: {}",
                    a.path == BnPath::CudnnFused
                );
            }
            check_against_reference(&format!("{what} [graph]"), shape, axis, fuse, &inp, 0.1, &a);
            let b = bn::run(&legacy, shape, axis, Run::plain(fuse, 0.1), &inp);
            assert!(!b.graph, "{what}: legacy must not run the graph");
            check_against_reference(
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
        let inp = Inputs::<f16>::uniform(&mut rng, n, 64);
        let out = bn::run(&ctx, shape, axis, Run::plain(Fuse::None, momentum), &inp);
        assert!(
            out.graph,
            "momentum {momentum}: the graph must run (f16 NHWC)"
        );
        check_against_reference(
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
    let inp = Inputs::<f16>::uniform(&mut rng, 4 * 14 * 14 * 32, 32);
    let out = bn::run(&ctx, &[4, 14, 14, 32], 3, Run::plain(Fuse::Relu, 0.1), &inp);
    assert!(!out.graph);
    assert_eq!(out.path, BnPath::CudnnFused);
}

/// The graph plan of `direction` with `epilogue` that the dispatcher of a `shape`/`axis`
/// BatchNorm on `ctx` uses for 16-byte-aligned buffers (the tests' allocations): from the plan
/// cache, so `true` means the dispatcher found (or would find) it built, `false` that cuDNN
/// refused it (remembered).
fn plan_built(
    ctx: &Context,
    shape: &[usize],
    axis: usize,
    dtype: DType,
    direction: BnDirection,
    epilogue: BnEpilogue,
) -> bool {
    let layout = BatchNorm::<f32>::new(ctx, shape, axis, Fuse::None)
        .unwrap()
        .plan()
        .layout;
    let policy = GraphPolicy {
        allow_runtime_compilation: true,
        ..GraphPolicy::default()
    };
    let key = GraphBnKey::new(layout, dtype, direction)
        .with_epilogue(epilogue)
        .with_policy(policy);
    match GraphBn::cached(ctx, key) {
        Ok(_) => true,
        Err(e) => {
            println!(
                "{shape:?} {dtype} {} {}: {e}",
                direction.name(),
                epilogue.name()
            );
            false
        }
    }
}

fn epilogue_of(fuse: Fuse) -> BnEpilogue {
    match fuse {
        Fuse::None => BnEpilogue::None,
        Fuse::Relu => BnEpilogue::Relu,
        Fuse::AddRelu => BnEpilogue::AddRelu,
    }
}

/// The training epilogues inside the graph for `T` on the NHWC shapes whose channel count is a
/// multiple of 8 (where cuDNN's graph BatchNorm finalizes): the forward ran BN + (add +) ReLU as
/// one graph and kept no mask, the backward graph (RELU_BWD from y → NORM_BACKWARD, d_addend)
/// builds, and every output matches the f64 reference and the legacy fused route (dx away from
/// ReLU kinks, where the two routes' roundings may put an element on either side of zero).
fn epilogue_grid<T: Element>(tag: &str) {
    let graph = ctx_for(CudnnApi::Graph);
    let legacy = ctx_for(CudnnApi::Legacy);
    let mut rng = Rng::fresh(tag);
    let tol = T::DTYPE.tolerance();
    for &(shape, axis) in NHWC.iter().filter(|(s, a)| s[*a] % 8 == 0) {
        let n: usize = shape.iter().product();
        let c = shape[axis];
        for fuse in [Fuse::Relu, Fuse::AddRelu] {
            let what = format!("{:?} {shape:?} {fuse:?} epilogue", T::DTYPE);
            let bn = BatchNorm::<T>::new(&graph, shape, axis, fuse).unwrap();
            assert_eq!(bn.plan().path, BnPath::CudnnFused, "{}", bn.plan());
            assert!(
                bn.plan()
                    .reasons
                    .iter()
                    .any(|r| r.starts_with("epilogue: graph")),
                "{}",
                bn.plan()
            );
            let inp = Inputs::<T>::uniform(&mut rng, n, c);
            let a = bn::run(&graph, shape, axis, Run::plain(fuse, 0.1), &inp);
            assert!(a.graph, "{what}: the graph must run");
            // cuDNN 9.19 on the H100 finalized none of these epilogue graphs (measured): the
            // plan's fallback then runs — graph BatchNorm and nnfuse's bitmask kernels, with a
            // mask — and is held to the same checks.
            if a.path == BnPath::CudnnFused {
                assert!(a.mask.is_none(), "{what}: the epilogue graph keeps no mask");
                let e = epilogue_of(fuse);
                assert!(
                    plan_built(&graph, shape, axis, T::DTYPE, BnDirection::Backward, e),
                    "{what}: the forward's epilogue graph ran, so its backward must build"
                );
                println!("{what}: the epilogue graph ran");
            } else {
                assert_eq!(a.path, BnPath::Fallback, "{what}");
                assert!(
                    a.mask.is_some(),
                    "{what}: the fallback keeps nnfuse's bitmask"
                );
                println!("{what}: cuDNN did not finalize the epilogue graph; the fallback ran");
            }
            check_against_reference(&what, shape, axis, fuse, &inp, 0.1, &a);
            let b = bn::run(&legacy, shape, axis, Run::plain(fuse, 0.1), &inp);
            assert!(!b.graph, "{what}");
            assert_close(&format!("{what}: y graph vs legacy"), &a.y, &b.y, tol);
            assert_close(
                &format!("{what}: running_var graph vs legacy"),
                &a.rv,
                &b.rv,
                1e-5,
            );
            let sh = BnShape::new(shape, axis).unwrap();
            let (ga, gb, kinks) = dx_away_from_kinks(&what, tol, &sh, &a, &b);
            println!("{what}: {kinks} ReLU kinks between the routes");
            assert_close(&format!("{what}: dx graph vs legacy"), &ga, &gb, tol);
            if let (Some(za), Some(zb)) = (&a.dz, &b.dz) {
                if kinks == 0 {
                    assert_close(&format!("{what}: d_addend graph vs legacy"), za, zb, tol);
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_epilogue_runs_nhwc_halves() {
    epilogue_grid::<f16>("graph_epilogue_f16");
    epilogue_grid::<bf16>("graph_epilogue_bf16");
}

/// Inference through the graph for `T` on `shapes`, every fusion: y against the f64 reference
/// (inside `bn::run`'s checks) and against the legacy inference call; returns how many cases
/// had their plain inference plan built, and in how many the epilogue plan built too.
fn inference_grid<T: Element>(tag: &str, shapes: &[(&[usize], usize)]) -> (usize, usize, usize) {
    let graph = ctx_for(CudnnApi::Graph);
    let legacy = ctx_for(CudnnApi::Legacy);
    let mut rng = Rng::fresh(tag);
    let tol = T::DTYPE.tolerance();
    let (mut plain, mut epilogue, mut all) = (0, 0, 0);
    for &(shape, axis) in shapes {
        let n: usize = shape.iter().product();
        let c = shape[axis];
        for fuse in Fuse::ALL {
            let what = format!("{:?} {shape:?} axis {axis} {fuse:?} inference", T::DTYPE);
            let bn = BatchNorm::<T>::new(&graph, shape, axis, fuse).unwrap();
            assert_eq!(
                bn.inference_plan().cudnn_api_used(),
                Some("graph"),
                "{}",
                bn.inference_plan()
            );
            let inp = Inputs::<T>::uniform(&mut rng, n, c);
            let a = bn::run(&graph, shape, axis, Run::plain(fuse, 0.1), &inp);
            check_against_reference(&what, shape, axis, fuse, &inp, 0.1, &a);
            let b = bn::run(&legacy, shape, axis, Run::plain(fuse, 0.1), &inp);
            assert_close(
                &format!("{what}: y graph vs legacy"),
                &a.y_inference,
                &b.y_inference,
                tol,
            );
            let d = BnDirection::Inference;
            let p = plan_built(&graph, shape, axis, T::DTYPE, d, BnEpilogue::None);
            let e = fuse != Fuse::None
                && plan_built(&graph, shape, axis, T::DTYPE, d, epilogue_of(fuse));
            println!("{what}: graph plan built: {p}, epilogue inside: {e}");
            plain += p as usize;
            epilogue += e as usize;
            all += 1;
        }
    }
    (plain, epilogue, all)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_inference_runs_nhwc_halves() {
    let shapes: Vec<(&[usize], usize)> = NHWC
        .iter()
        .copied()
        .filter(|(s, a)| s[*a] % 8 == 0)
        .collect();
    for (what, (plain, epilogue, all)) in [
        ("f16", inference_grid::<f16>("graph_infer_f16", &shapes)),
        ("bf16", inference_grid::<bf16>("graph_infer_bf16", &shapes)),
    ] {
        // cuDNN 9.19 on the H100 lists no engine for NORM_FORWARD in the inference phase
        // (heuristics: NOT_SUPPORTED, every shape and type tried): the legacy call runs, checked
        // against the reference and the legacy route by `inference_grid` either way. All or
        // nothing: a plan for some cases but not others would be a key or descriptor bug.
        println!("support: {what} NHWC inference: plan {plain} of {all}, epilogue {epilogue}");
        assert!(
            plain == all || plain == 0,
            "{what}: the inference graph built for {plain} of {all} cases"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_inference_matches_reference_everywhere() {
    // Whichever route ran (graph, or the legacy call where no plan builds) is checked.
    let r = [
        (
            "f32 NHWC",
            inference_grid::<f32>("graph_infer_f32_nhwc", NHWC),
        ),
        (
            "f32 NCHW",
            inference_grid::<f32>("graph_infer_f32_nchw", NCHW),
        ),
        (
            "f16 NHWC C%8!=0",
            inference_grid::<f16>("graph_infer_f16_odd", &NHWC[2..3]),
        ),
        (
            "bf16 NCHW",
            inference_grid::<bf16>("graph_infer_bf16_nchw", NCHW),
        ),
    ];
    for (what, (plain, epilogue, all)) in r {
        println!("support: {what} inference: plan {plain} of {all}, epilogue {epilogue}");
    }
}

/// The inverse standard deviation is computed per call from the running variance given: two
/// inferences on the same cached plan with different running statistics give each one's result.
#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_inference_reads_each_calls_running_statistics() {
    let ctx = ctx_for(CudnnApi::Graph);
    let (shape, axis) = (&[8usize, 7, 7, 64][..], 3);
    let mut rng = Rng::fresh("graph_infer_stats");
    let n: usize = shape.iter().product();
    for scale in [1.0f32, 4.0, 0.25] {
        let mut inp = Inputs::<f16>::uniform(&mut rng, n, 64);
        for v in inp.rv.iter_mut() {
            *v *= scale;
        }
        let out = bn::run(&ctx, shape, axis, Run::plain(Fuse::None, 0.1), &inp);
        check_against_reference(
            &format!("running_var x{scale}"),
            shape,
            axis,
            Fuse::None,
            &inp,
            0.1,
            &out,
        );
    }
    // Whether the graph ran (cuDNN 9.19 on the H100 builds no inference plan: the legacy call
    // ran, reading each call's statistics as well).
    let built = plan_built(
        &ctx,
        shape,
        axis,
        DType::F16,
        BnDirection::Inference,
        BnEpilogue::None,
    );
    println!("inference graph plan built: {built}");
}

/// Why the epilogue graphs are refused where they are (printed for docs/CUDNN-GRAPH.md): each
/// direction's plan with each epilogue on one NHWC shape. The plain graphs build there (the
/// grids above run them), so a refused epilogue plan must carry cuDNN's reason, not nothing.
#[test]
#[ignore = "needs a CUDA GPU"]
fn epilogue_plans_say_why_they_are_refused() {
    let ctx = ctx_for(CudnnApi::Graph);
    let (shape, axis) = (&[4usize, 14, 14, 32][..], 3);
    for dtype in [DType::F16, DType::BF16] {
        for direction in [BnDirection::Forward, BnDirection::Backward] {
            assert!(
                plan_built(&ctx, shape, axis, dtype, direction, BnEpilogue::None),
                "{dtype} {}: the plain graph builds",
                direction.name()
            );
            for e in [BnEpilogue::Relu, BnEpilogue::AddRelu] {
                let built = plan_built(&ctx, shape, axis, dtype, direction, e);
                println!(
                    "EPILOGUE {dtype} {} {}: {}",
                    direction.name(),
                    e.name(),
                    if built {
                        "built"
                    } else {
                        "refused (reason above)"
                    }
                );
            }
        }
    }
}
