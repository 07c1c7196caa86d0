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

use common::bn::{self, check_against_reference, Inputs, Run};
use common::*;
use half::{bf16, f16};
use nnfuse::batchnorm::{BatchNorm, BnPath, Fuse};
use nnfuse::{BnImpl, Config, Context, CudnnApi, Element};

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
            // Epilogues run as nnfuse's bitmask kernels after graph BatchNorm.
            if a.graph && fuse != Fuse::None {
                assert_eq!(a.path, BnPath::Fallback, "{what}");
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
