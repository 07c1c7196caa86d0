//! nnfuse's own BatchNorm kernels on the GPU (issue 9): against the f64 reference over a grid of
//! ranks, axes, layouts, channel counts (1, 3, 30, 64, 2048, 2100, 5000) and elements per channel (2 to
//! 10^7), every fusion and data type, both variants (two-pass and persistent, each forced),
//! aligned and unaligned views; path against path (own vs cuDNN's fallback vs cuDNN's fused) on
//! identical inputs; accuracy on hard inputs next to cuDNN SPATIAL's; NaN in, NaN out;
//! determinism. Ignored without a GPU.
//!
//! Every failure names the case (shape, axis, dtype, fusion, variant, view offset), the output
//! and its error; the seed of the random inputs is printed first.

mod common;

use common::bn::{
    self, activation, activation_backward, check_forward, dx_away_from_kinks, Inputs, Outputs, Run,
    EPS,
};
use common::*;
use half::{bf16, f16};
use nnfuse::batchnorm::{BatchNorm, BnOptions, BnPath, Fuse, OwnVariant, OwnVariantChoice};
use nnfuse::internals::batchnorm::{OWN_PER_CHANNEL_MAX_M, PREFER_PERSISTENT};
use nnfuse::reference::activation::relu_mask_fwd;
use nnfuse::reference::batchnorm::{self as rb, BnShape};
use nnfuse::{BnImpl, BnModePolicy, Config, Context, DType, Element};

/// What a case's inputs look like.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Data {
    /// x uniform in [-2, 3).
    Uniform,
    /// Per channel: mean in [50, 100), standard deviation in [0.5, 1].
    Offset,
    /// Positive values log-uniform over [1e-3, 1e3].
    Wide,
}

fn inputs<T: Element>(rng: &mut Rng, sh: &BnShape, data: Data) -> Inputs<T> {
    let n = sh.numel();
    let c = sh.c;
    let x = match data {
        Data::Uniform => rng.vec(n, -2.0, 3.0),
        Data::Offset => {
            let params: Vec<(f64, f64)> = (0..c)
                .map(|_| (rng.uniform(50.0, 100.0), rng.uniform(0.5, 1.0)))
                .collect();
            let mut x = vec![T::default(); n];
            for o in 0..sh.outer {
                for ch in 0..c {
                    for i in 0..sh.inner {
                        let (m, s) = params[ch];
                        // Uniform with the channel's standard deviation.
                        let u = rng.uniform(-1.0, 1.0) * s * 3f64.sqrt();
                        x[sh.index(o, ch, i)] = T::from_f64(m + u);
                    }
                }
            }
            x
        }
        Data::Wide => (0..n)
            .map(|_| T::from_f64(10f64.powf(rng.uniform(-3.0, 3.0))))
            .collect(),
    };
    Inputs::with_x(rng, x, c)
}

impl Outputs {
    /// Every output's bits, for the determinism check.
    fn bits(&self) -> Vec<u64> {
        let mut v: Vec<u64> = Vec::new();
        for s in [
            &self.y,
            &self.rm,
            &self.rv,
            &self.saved_mean,
            &self.saved_inv_std,
            &self.dx,
            &self.dgamma,
            &self.dbeta,
            &self.y_inference,
        ] {
            v.extend(s.iter().map(|x| x.to_bits()));
        }
        if let Some(d) = &self.dz {
            v.extend(d.iter().map(|x| x.to_bits()));
        }
        if let Some(m) = &self.mask {
            v.extend(m.iter().map(|&w| u64::from(w)));
        }
        v
    }
}

/// The f64 reference of one case (forward with the given momentum, inference with the
/// original running statistics).
struct Reference {
    fwd: rb::BnForward,
    y_inference: Vec<f64>,
}

fn reference<T: Element>(sh: &BnShape, fuse: Fuse, inp: &Inputs<T>, momentum: f64) -> Reference {
    let x = f64s(&inp.x);
    let z = f64s(&inp.z);
    let (g, b) = (f64s(&inp.gamma), f64s(&inp.beta));
    let (rm, rv) = (f64s(&inp.rm), f64s(&inp.rv));
    let act = activation(fuse, &z);
    Reference {
        fwd: rb::train_forward(sh, &x, &g, &b, &rm, &rv, momentum, EPS, act).unwrap(),
        y_inference: rb::inference_forward(sh, &x, &g, &b, &rm, &rv, EPS, act).unwrap(),
    }
}

/// Relative errors of one run against the reference (y, dx), returned for reports.
#[derive(Debug, Clone, Copy)]
struct Errors {
    y: f64,
    dx: f64,
    mean: f64,
    inv_std: f64,
}

/// Checks one own run against the reference: every output, the mask equal to (y > 0), the
/// statistics to 2e-6 (they are f32 sums of exactly the inputs the reference sees).
fn check<T: Element>(
    what: &str,
    sh: &BnShape,
    fuse: Fuse,
    inp: &Inputs<T>,
    rf: &Reference,
    out: &Outputs,
) -> Errors {
    let tol = T::DTYPE.tolerance();
    let w = |s: &str| format!("{what}: {s}");
    let f = &rf.fwd;
    assert_eq!(out.path, BnPath::Own, "{what}: path");
    check_forward(w, out, f, tol, 2e-6);
    let gpu_mask = relu_mask_fwd(&out.y).1;
    match (&out.mask, fuse) {
        (None, Fuse::None) => {}
        (Some(m), Fuse::Relu | Fuse::AddRelu) => {
            if let Some(i) = (0..gpu_mask.len()).find(|&i| m[i] != gpu_mask[i]) {
                panic!(
                    "{what}: mask word {i} is {:#010x}, (y > 0) gives {:#010x}",
                    m[i], gpu_mask[i]
                );
            }
        }
        (m, _) => panic!("{what}: mask {:?} for {fuse:?}", m.as_ref().map(Vec::len)),
    }
    let gr = backward_ref(sh, fuse, inp, rf, &gpu_mask);
    assert_close_stored(&w("dx"), T::DTYPE, &out.dx, &gr.dx, tol);
    let (sq_b, sq_g) = term_squares(sh, fuse, inp, rf, &gpu_mask);
    assert_sums_close(&w("dgamma"), &out.dgamma, &gr.dgamma, &sq_g, tol.max(1e-5));
    assert_sums_close(&w("dbeta"), &out.dbeta, &gr.dbeta, &sq_b, tol.max(1e-5));
    match (&out.dz, &gr.d_addend) {
        (Some(dz), Some(want)) => assert_close(&w("d_addend"), dz, want, tol),
        (None, None) => {}
        _ => panic!("{what}: d_addend presence"),
    }
    assert_close(&w("y (inference)"), &out.y_inference, &rf.y_inference, tol);
    Errors {
        y: rel_l2(&out.y, &f.y),
        dx: rel_l2(&out.dx, &gr.dx),
        mean: rel_l2(&out.saved_mean, &f.saved_mean),
        inv_std: rel_l2(&out.saved_inv_std, &f.saved_inv_std),
    }
}

/// Per channel, `Σ t²` of the terms of dβ = Σ dy' and of dγ = Σ dy' x̂ (dy' = dy through the
/// mask where an activation is fused).
fn term_squares<T: Element>(
    sh: &BnShape,
    fuse: Fuse,
    inp: &Inputs<T>,
    rf: &Reference,
    mask: &[u32],
) -> (Vec<f64>, Vec<f64>) {
    let (x, dy) = (f64s(&inp.x), f64s(&inp.dy));
    let (mean, inv) = (&rf.fwd.saved_mean, &rf.fwd.saved_inv_std);
    let (mut b, mut g) = (vec![0.0; sh.c], vec![0.0; sh.c]);
    for k in 0..x.len() {
        let on = fuse == Fuse::None || (mask[k / 32] >> (k % 32)) & 1 == 1;
        if !on {
            continue;
        }
        let c = (k / sh.inner) % sh.c;
        let t = dy[k];
        b[c] += t * t;
        let tg = t * (x[k] - mean[c]) * inv[c];
        g[c] += tg * tg;
    }
    (b, g)
}

/// A per-channel sum against its reference: within `tol` of the larger of |want| and `√(Σ t²)`,
/// the size a sum of its terms has when their signs are random. A sum that cancels far below
/// its terms is judged at its terms' scale (the GPU adds millions of f32 terms: a channel of 5
/// million whose dβ came to 4.39 was 6e-4 off, 1.4e-4 relative, 5e-7 of √(Σ t²)); dropping or
/// doubling any one term of size ~√(Σ t² / M) still fails.
fn assert_sums_close(what: &str, got: &[f64], want: &[f64], sq: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for c in 0..want.len() {
        let scale = want[c].abs().max(sq[c].sqrt());
        let err = (got[c] - want[c]).abs();
        assert!(
            got[c].is_finite() && err <= tol * scale + 1e-30,
            "{what}: channel {c}: {} against {} (error {err:.3e} > {tol:.1e} of {scale:.3e}, \
             the larger of |want| and the terms' root sum of squares {:.3e})",
            got[c],
            want[c],
            sq[c].sqrt()
        );
    }
}

/// The f64 backward on `inp` about the reference's saved statistics, with ReLU mask `mask`.
fn backward_ref<T: Element>(
    sh: &BnShape,
    fuse: Fuse,
    inp: &Inputs<T>,
    rf: &Reference,
    mask: &[u32],
) -> rb::BnGrads {
    let act_bwd = activation_backward(fuse, mask);
    let (x, dy, g) = (f64s(&inp.x), f64s(&inp.dy), f64s(&inp.gamma));
    let f = &rf.fwd;
    rb::backward(sh, &x, &dy, &g, &f.saved_mean, &f.saved_inv_std, act_bwd).unwrap()
}

/// dx's relative L2 error against the f64 backward (with the mask of `out`'s own y), for a
/// path that `check` does not cover (cuDNN's).
fn dx_error<T: Element>(
    sh: &BnShape,
    fuse: Fuse,
    inp: &Inputs<T>,
    rf: &Reference,
    out: &Outputs,
) -> f64 {
    let gr = backward_ref(sh, fuse, inp, rf, &relu_mask_fwd(&out.y).1);
    rel_l2(&out.dx, &gr.dx)
}

/// Two paths on identical inputs agree: y within tolerance; the ReLU masks (y > 0) agree except
/// at a few kinks, where the pre-activation is within rounding of zero; dx within tolerance over
/// the channels without a kink (a flip moves its channel's sums).
/// `dx_tol` bounds dx (tol, unless one path is known to be further than tol from f64).
/// One unit in the last place of `dt` at `v` (0 at 0).
fn ulp(dt: DType, v: f64) -> f64 {
    let mantissa = match dt {
        DType::F32 => 23,
        DType::F16 => 10,
        DType::BF16 => 7,
    };
    if v == 0.0 {
        0.0
    } else {
        2f64.powi(v.abs().log2().floor() as i32 - mantissa)
    }
}

fn compare_paths(
    what: &str,
    dt: DType,
    (tol, dx_tol): (f64, f64),
    sh: &BnShape,
    a: &Outputs,
    b: &Outputs,
) {
    // Each path rounds y to `dt` once: values near a rounding boundary may land one unit in the
    // last place apart, which on a few elements (a [2, 3] input) is a visible relative L2.
    let norm = b.y.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-300);
    let units =
        a.y.iter()
            .zip(&b.y)
            .map(|(x, y)| ulp(dt, x.abs().max(y.abs())).powi(2))
            .sum::<f64>()
            .sqrt();
    assert_close(&format!("{what}: y"), &a.y, &b.y, tol + units / norm);
    let (a_dx, b_dx, kinks) = dx_away_from_kinks(what, tol, sh, a, b);
    assert_close(
        &format!("{what}: dx (away from {kinks} kinks)"),
        &a_dx,
        &b_dx,
        dx_tol,
    );
    assert_close(
        &format!("{what}: saved_mean"),
        &a.saved_mean,
        &b.saved_mean,
        1e-5,
    );
}

fn own_ctx() -> Context {
    gpu_with(Config::default().with_bn_impl(BnImpl::Own))
}

/// The grid: rank 2 to 5, channels first and last, axis 0 and in the middle, C = 1, 3, 12, 30,
/// 64, 1000, 2048 (the most staged in shared memory), 5000 (not staged), elements per channel
/// from 2 up, runs and rows that are and are not whole vectors or mask words (every apply mode:
/// one run per vector, two runs per vector, channels-last registers, elements).
const SHAPES: &[(&[usize], usize)] = &[
    (&[256, 64], 1),        // 2-D
    (&[2, 3], 1),           // 2-D, two values per channel
    (&[3, 2048], 1),        // 2-D, C = 2048
    (&[2, 5000], 1),        // 2-D, C = 5000: coefficients not staged
    (&[6, 20], 0),          // axis 0 of a 2-D tensor (channels-first, one run)
    (&[8, 12, 50], 1),      // 3-D channels-first, runs of 50
    (&[4, 24, 14, 14], 1),  // runs of 196 (not whole 16-byte vectors in 16-bit types)
    (&[2, 3, 32, 32], 1),   // C = 3, runs of 1024: persistent
    (&[2, 1, 3, 3], 1),     // C = 1
    (&[4, 64, 8, 8], 1),    // C = 64, runs of 64: persistent
    (&[2, 2048, 2, 2], 1),  // C = 2048, runs of 4
    (&[4, 14, 14, 32], 3),  // channels-last, C = 32: persistent
    (&[4, 14, 14, 30], 3),  // channels-last, C = 30
    (&[1, 8, 8, 32], 3),    // N = 1
    (&[16, 32, 1, 1], 1),   // H = W = 1 (NHWC)
    (&[2, 8, 4, 6, 5], 1),  // 5-D channels-first
    (&[2, 4, 6, 5, 16], 4), // 5-D channels-last
    (&[3, 5, 12, 7], 2),    // axis in the middle
    (&[2, 8, 8, 64], 3),    // channels-last C = 64: persistent
    (&[4, 32, 56, 56], 1),  // 401k elements, channels-first
    (&[8, 28, 28, 64], 3),  // 401k elements, channels-last
    (&[3, 40, 7, 7], 1),    // runs of 49: vectors across two runs in every type
    (&[2, 5, 5, 1000], 3),  // channels-last C = 1000: 125 (f16) / 250 (f32) chunk classes
];

fn grid<T: Element>(tag: &str) {
    let own = own_ctx();
    let cudnn = gpu_with(Config::default().with_bn_impl(BnImpl::Cudnn));
    let fallback = gpu_with(
        Config::default()
            .with_bn_impl(BnImpl::Cudnn)
            .with_cudnn_fusion_disabled(true),
    );
    let mut rng = Rng::fresh(tag);
    let tol = T::DTYPE.tolerance();
    let mut persistent_runs = 0;
    for (k, &(shape, axis)) in SHAPES.iter().enumerate() {
        let sh = BnShape::new(shape, axis).unwrap();
        for fuse in Fuse::ALL {
            let inp = inputs::<T>(&mut rng, &sh, Data::Uniform);
            let rf = reference(&sh, fuse, &inp, 0.1);
            let mut outs = Vec::new();
            // Both variants aligned; every third case also as views at an odd element.
            let offsets: &[usize] = if k % 3 == 0 { &[0, 1] } else { &[0] };
            for &offset in offsets {
                for variant in [OwnVariantChoice::TwoPass, OwnVariantChoice::Persistent] {
                    let r = Run {
                        fuse,
                        variant,
                        offset,
                        momentum: 0.1,
                    };
                    let what = format!(
                        "{:?} {shape:?} axis {axis} {fuse:?} {variant:?} offset {offset}",
                        T::DTYPE
                    );
                    let out = bn::run(&own, shape, axis, r, &inp);
                    check(&what, &sh, fuse, &inp, &rf, &out);
                    // The variants that ran: the plan's, except that an unaligned view runs
                    // two-pass where persistent was planned (these tensors all fit an H100);
                    // few values per channel run the backward per channel in f64.
                    let bn = BatchNorm::<T>::with_options(
                        &own,
                        shape,
                        axis,
                        fuse,
                        BnOptions {
                            own_variant: variant,
                        },
                    )
                    .unwrap();
                    let planned = (bn.plan().own_forward, bn.plan().own_backward);
                    let ran = |p: Option<OwnVariant>| match p {
                        Some(OwnVariant::Persistent) if offset != 0 => Some(OwnVariant::TwoPass),
                        p => p,
                    };
                    let want = (ran(planned.0), ran(planned.1));
                    assert_eq!(
                        (out.fwd_variant, out.bwd_variant),
                        want,
                        "{what}: variants that ran (plan: {planned:?}); NNFUSE_LOG=debug shows why"
                    );
                    if sh.per_channel() <= OWN_PER_CHANNEL_MAX_M as usize {
                        assert_eq!(want.1, Some(OwnVariant::PerChannel), "{what}");
                    }
                    persistent_runs += (want.0 == Some(OwnVariant::Persistent)) as usize;
                    outs.push(out);
                }
            }
            // Own against itself across variants and views, then against cuDNN.
            let what = format!("{:?} {shape:?} axis {axis} {fuse:?}", T::DTYPE);
            for o in &outs[1..] {
                compare_paths(
                    &format!("{what} own variants"),
                    T::DTYPE,
                    (tol, tol),
                    &sh,
                    &outs[0],
                    o,
                );
            }
            let r = Run {
                fuse,
                variant: OwnVariantChoice::Auto,
                offset: 0,
                momentum: 0.1,
            };
            let cu = bn::run(&cudnn, shape, axis, r, &inp);
            // With few values per channel dx is mostly cancellation: own's is checked against
            // f64 above (per channel in f64 there); cuDNN's may itself be further than tol from
            // f64, and then the two can only agree to within cuDNN's distance.
            let own_dx = dx_error(&sh, fuse, &inp, &rf, &outs[0]);
            let dx_tol_vs = |o: &Outputs, name: &str| {
                let e = dx_error(&sh, fuse, &inp, &rf, o);
                if e > tol {
                    println!("note {what}: cuDNN {name} dx is {e:.2e} from f64 (own {own_dx:.2e})");
                }
                tol.max(1.5 * (e + own_dx))
            };
            let cu_tol = dx_tol_vs(&cu, &format!("{:?}", cu.path));
            compare_paths(
                &format!("{what} own vs cuDNN {:?}", cu.path),
                T::DTYPE,
                (tol, cu_tol),
                &sh,
                &outs[0],
                &cu,
            );
            if fuse != Fuse::None && cu.path == BnPath::CudnnFused {
                let fb = bn::run(&fallback, shape, axis, r, &inp);
                assert_eq!(fb.path, BnPath::Fallback, "{what}");
                let fb_tol = dx_tol_vs(&fb, "fallback");
                compare_paths(
                    &format!("{what} own vs cuDNN fallback"),
                    T::DTYPE,
                    (tol, fb_tol),
                    &sh,
                    &outs[0],
                    &fb,
                );
            }
            println!("ok {what} (cuDNN path {:?})", cu.path);
        }
    }
    assert!(
        persistent_runs > 0,
        "the grid never ran the persistent kernels"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn own_grid_f32() {
    grid::<f32>("own f32");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn own_grid_f16() {
    grid::<f16>("own f16");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn own_grid_bf16() {
    grid::<bf16>("own bf16");
}

/// Few values per channel (M = 2 .. 65), where dx is a small remainder of its terms (at M = 2 a
/// fraction eps/var of them): the per-channel f64 backward against the f64 reference at the
/// usual tolerance, on uniform, offset and wide inputs, both layouts, every fusion; M = 65 is
/// the first size on the f32 kernels. Prints each case's dx error.
#[test]
#[ignore = "needs a CUDA GPU"]
fn few_values_per_channel_match_f64() {
    fn run<T: Element>(own: &Context, rng: &mut Rng) {
        for (shape, axis) in [
            (&[2usize, 64][..], 1usize), // M = 2, channels-last
            (&[1, 8, 2], 1),             // M = 2, channels-first
            (&[3, 30], 1),               // M = 3
            (&[2, 5, 2, 2], 1),          // M = 8, channels-first runs of 4
            (&[64, 16], 1),              // M = 64, the last per-channel size
            (&[65, 16], 1),              // M = 65, f32 kernels
        ] {
            let sh = BnShape::new(shape, axis).unwrap();
            // Wide inputs at M = 2 or 3 make var/eps up to 1e10: the f64 reference itself
            // is then only good to about 1e-6, too close to the tolerance to judge.
            let datas: &[Data] = if sh.per_channel() >= 8 {
                &[Data::Uniform, Data::Offset, Data::Wide]
            } else {
                &[Data::Uniform, Data::Offset]
            };
            for &data in datas {
                for fuse in Fuse::ALL {
                    let inp = inputs::<T>(rng, &sh, data);
                    let rf = reference(&sh, fuse, &inp, 0.1);
                    let r = Run {
                        fuse,
                        variant: OwnVariantChoice::Auto,
                        offset: 0,
                        momentum: 0.1,
                    };
                    let out = bn::run(own, shape, axis, r, &inp);
                    let what = format!("{:?} {shape:?} {data:?} {fuse:?}", T::DTYPE);
                    // M = 65 is [65, 16]: (N, C) input, which takes the channels-last rule.
                    let want_bwd = if sh.per_channel() <= OWN_PER_CHANNEL_MAX_M as usize {
                        OwnVariant::PerChannel
                    } else if PREFER_PERSISTENT {
                        OwnVariant::Persistent
                    } else {
                        OwnVariant::TwoPass
                    };
                    assert_eq!(out.bwd_variant, Some(want_bwd), "{what}");
                    let e = check(&what, &sh, fuse, &inp, &rf, &out);
                    println!("ok {what}: backward {want_bwd:?}, dx {:.2e}", e.dx);
                }
            }
        }
    }
    let own = own_ctx();
    let mut rng = Rng::fresh("few values");
    run::<f32>(&own, &mut rng);
    run::<f16>(&own, &mut rng);
    run::<bf16>(&own, &mut rng);
}

/// 10^7 elements per channel (channels-first and channels-last, C = 1), two-pass: many blocks
/// per channel, every partial combined.
#[test]
#[ignore = "needs a CUDA GPU"]
fn ten_million_elements_per_channel() {
    let own = own_ctx();
    let mut rng = Rng::fresh("ten million");
    for (shape, axis) in [
        (&[10usize, 1, 1000, 1000][..], 1usize),
        (&[10_000_000, 1], 1),
    ] {
        let sh = BnShape::new(shape, axis).unwrap();
        let inp = inputs::<f32>(&mut rng, &sh, Data::Offset);
        let t = std::time::Instant::now();
        let rf = reference(&sh, Fuse::Relu, &inp, 0.1);
        let r = Run {
            fuse: Fuse::Relu,
            variant: OwnVariantChoice::Auto,
            offset: 0,
            momentum: 0.1,
        };
        let out = bn::run(&own, shape, axis, r, &inp);
        let e = check(
            &format!("f32 {shape:?} relu"),
            &sh,
            Fuse::Relu,
            &inp,
            &rf,
            &out,
        );
        println!(
            "ok f32 {shape:?}: variant {:?}, y {:.2e} dx {:.2e} mean {:.2e} inv_std {:.2e} \
             ({:.1} s with the reference)",
            out.fwd_variant,
            e.y,
            e.dx,
            e.mean,
            e.inv_std,
            t.elapsed().as_secs_f64()
        );
    }
}

/// Inputs with a large common offset and inputs spanning 1e-3 to 1e3, f32, channels-first,
/// channels-last and 2-D: the own kernels'
/// statistics within 1e-6 relative of f64 (saved mean; variance read from running_var with
/// momentum 1), and y and dx no worse than cuDNN SPATIAL's on the same inputs. Both errors are
/// printed (the issue's closing note reports them).
#[test]
#[ignore = "needs a CUDA GPU"]
fn accuracy_beats_cudnn_spatial_on_hard_inputs() {
    let own = own_ctx();
    // OneFlow's mode rule with the NHWC flag off: CUDNN_BATCHNORM_SPATIAL (PER_ACTIVATION for
    // 2-D input), never SPATIAL_PERSISTENT, which auto takes for channels-last and 2-D training.
    let spatial = gpu_with(
        Config::default()
            .with_bn_impl(BnImpl::Cudnn)
            .with_bn_mode_policy(BnModePolicy::OneFlow)
            .with_nhwc(false),
    );
    let mut rng = Rng::fresh("accuracy");
    println!(
        "| data | shape | variant | mean rel | var rel | y own | y cuDNN | dx own | dx cuDNN |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for data in [Data::Offset, Data::Wide] {
        for (shape, axis) in [
            (&[8usize, 16, 56, 56][..], 1usize),
            (&[4, 8, 128, 128], 1),
            (&[8, 28, 28, 64], 3),
            (&[4096, 32], 1),
        ] {
            let sh = BnShape::new(shape, axis).unwrap();
            let inp = inputs::<f32>(&mut rng, &sh, data);
            // momentum 1: running_var is the unbiased batch variance itself.
            let rf = reference(&sh, Fuse::None, &inp, 1.0);
            let r = Run {
                fuse: Fuse::None,
                variant: OwnVariantChoice::Auto,
                offset: 0,
                momentum: 1.0,
            };
            let cu = bn::run(&spatial, shape, axis, r, &inp);
            let bn = BatchNorm::<f32>::new(&spatial, shape, axis, Fuse::None).unwrap();
            // 2-D input: OneFlow's PER_ACTIVATION, which for rank 2 is the same per-channel
            // statistics through cuDNN's plain (not persistent) kernels.
            let want_mode = if shape.len() == 2 {
                nnfuse::batchnorm::BnMode::PerActivation
            } else {
                nnfuse::batchnorm::BnMode::Spatial
            };
            assert_eq!(bn.plan().mode, want_mode, "{shape:?}");
            let cu_e = (
                rel_l2(&cu.y, &rf.fwd.y),
                dx_error(&sh, Fuse::None, &inp, &rf, &cu),
            );
            for variant in [OwnVariantChoice::TwoPass, OwnVariantChoice::Persistent] {
                let out = bn::run(&own, shape, axis, Run { variant, ..r }, &inp);
                let what = format!("{data:?} f32 {shape:?} {variant:?}");
                let e = check(&what, &sh, Fuse::None, &inp, &rf, &out);
                let mean_rel = max_rel(&out.saved_mean, &rf.fwd.saved_mean);
                let var_rel = max_rel(&out.rv, &rf.fwd.running_var);
                println!(
                    "| {data:?} | {shape:?} | {:?} | {mean_rel:.1e} | {var_rel:.1e} | {:.2e} | {:.2e} | {:.2e} | {:.2e} |",
                    out.fwd_variant, e.y, cu_e.0, e.dx, cu_e.1
                );
                assert!(mean_rel <= 1e-6, "{what}: saved mean {mean_rel:.2e} > 1e-6");
                assert!(var_rel <= 1e-6, "{what}: variance {var_rel:.2e} > 1e-6");
                // No worse than cuDNN SPATIAL (10% and a rounding-level floor for noise).
                assert!(
                    e.y <= cu_e.0 * 1.1 + 2e-8,
                    "{what}: y error {:.2e} above cuDNN SPATIAL's {:.2e}",
                    e.y,
                    cu_e.0
                );
                assert!(
                    e.dx <= cu_e.1 * 1.1 + 2e-8,
                    "{what}: dx error {:.2e} above cuDNN SPATIAL's {:.2e}",
                    e.dx,
                    cu_e.1
                );
            }
        }
    }
}

/// A NaN in x makes its channel NaN (training: statistics, y, dx, dgamma) and only its element
/// (inference); everything else stays finite and right.
#[test]
#[ignore = "needs a CUDA GPU"]
fn nan_in_nan_out() {
    let own = own_ctx();
    let mut rng = Rng::fresh("nan");
    for (shape, axis) in [
        (&[2usize, 3, 8, 8][..], 1usize),
        (&[2, 4, 4, 32], 3),
        (&[5, 3, 7], 1),
    ] {
        for variant in [OwnVariantChoice::TwoPass, OwnVariantChoice::Persistent] {
            let sh = BnShape::new(shape, axis).unwrap();
            let mut inp = inputs::<f32>(&mut rng, &sh, Data::Uniform);
            let bad = sh.index(sh.outer - 1, 1, sh.inner - 1);
            inp.x[bad] = f32::NAN;
            let r = Run {
                fuse: Fuse::Relu,
                variant,
                offset: 0,
                momentum: 0.1,
            };
            let out = bn::run(&own, shape, axis, r, &inp);
            let rf = reference(&sh, Fuse::Relu, &inp, 0.1);
            let what = format!("{shape:?} {variant:?}");
            let channel = |i: usize| (i / sh.inner) % sh.c;
            for i in 0..sh.numel() {
                if channel(i) == 1 {
                    assert!(
                        out.y[i].is_nan(),
                        "{what}: y[{i}] = {} in the NaN channel",
                        out.y[i]
                    );
                    assert!(out.dx[i].is_nan(), "{what}: dx[{i}] in the NaN channel");
                } else {
                    assert!(
                        out.y[i].is_finite() && out.dx[i].is_finite(),
                        "{what}: element {i}"
                    );
                }
                let yi_nan = out.y_inference[i].is_nan();
                assert_eq!(yi_nan, i == bad, "{what}: inference y[{i}] NaN = {yi_nan}");
            }
            assert!(
                out.saved_mean[1].is_nan() && out.dgamma[1].is_nan(),
                "{what}"
            );
            for ch in [0, 2] {
                assert!(
                    (out.saved_mean[ch] - rf.fwd.saved_mean[ch]).abs()
                        <= 1e-6 * rf.fwd.saved_mean[ch].abs().max(1.0),
                    "{what}: channel {ch} mean"
                );
                assert!(
                    out.dgamma[ch].is_finite() && out.dbeta[ch].is_finite(),
                    "{what}"
                );
            }
            // The NaN channel's mask bits are all zero (NaN > 0 is false).
            let m = out.mask.as_ref().unwrap();
            for i in (0..sh.numel()).filter(|&i| channel(i) == 1) {
                assert_eq!((m[i / 32] >> (i % 32)) & 1, 0, "{what}: mask bit {i}");
            }
        }
    }
}

/// Two runs on the same inputs give the same bits (fixed-order combination, no float atomics),
/// for both variants and both layouts, with many blocks per channel.
#[test]
#[ignore = "needs a CUDA GPU"]
fn deterministic() {
    let own = own_ctx();
    let mut rng = Rng::fresh("determinism");
    for (shape, axis) in [
        (&[16usize, 4, 64, 64][..], 1usize),
        (&[64, 32, 32, 16], 3),
        (&[65536, 8], 1),
    ] {
        let sh = BnShape::new(shape, axis).unwrap();
        for fuse in [Fuse::Relu, Fuse::AddRelu] {
            let inp = inputs::<f16>(&mut rng, &sh, Data::Uniform);
            for variant in [OwnVariantChoice::TwoPass, OwnVariantChoice::Persistent] {
                let r = Run {
                    fuse,
                    variant,
                    offset: 0,
                    momentum: 0.1,
                };
                let a = bn::run(&own, shape, axis, r, &inp);
                let b = bn::run(&own, shape, axis, r, &inp);
                let (ba, bb) = (a.bits(), b.bits());
                if let Some(i) = (0..ba.len()).find(|&i| ba[i] != bb[i]) {
                    panic!(
                        "{shape:?} {fuse:?} {variant:?} ({:?}): two runs differ at output word {i}",
                        a.fwd_variant
                    );
                }
                println!("ok {shape:?} {fuse:?} {:?}: identical bits", a.fwd_variant);
            }
        }
    }
}

/// The plan's auto choice runs and agrees with the reference on the shapes of the issue's
/// table (reduced batch), under the default configuration (no forced implementation).
#[test]
#[ignore = "needs a CUDA GPU"]
fn default_configuration_on_the_issue_shapes() {
    let ctx = gpu();
    let mut rng = Rng::fresh("issue shapes");
    for (shape, axis, fuse) in [
        (&[4usize, 64, 112, 112][..], 1usize, Fuse::Relu),
        (&[2, 32, 112, 112], 1, Fuse::AddRelu),
        (&[4, 56, 56, 256], 3, Fuse::AddRelu),
        (&[4096, 256], 1, Fuse::Relu),
    ] {
        let sh = BnShape::new(shape, axis).unwrap();
        let inp = inputs::<f16>(&mut rng, &sh, Data::Uniform);
        let rf = reference(&sh, fuse, &inp, 0.1);
        let r = Run {
            fuse,
            variant: OwnVariantChoice::Auto,
            offset: 0,
            momentum: 0.1,
        };
        let out = bn::run(&ctx, shape, axis, r, &inp);
        let bn = BatchNorm::<f16>::new(&ctx, shape, axis, fuse).unwrap();
        assert_eq!(out.path, bn.plan().path, "{shape:?}");
        if out.path == BnPath::Own {
            check(
                &format!("f16 {shape:?} {fuse:?} (auto)"),
                &sh,
                fuse,
                &inp,
                &rf,
                &out,
            );
        }
        println!(
            "ok f16 {shape:?} {fuse:?}: path {:?}, variants {:?} / {:?}",
            out.path, out.fwd_variant, out.bwd_variant
        );
    }
}
