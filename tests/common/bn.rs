//! What the BatchNorm GPU tests (gpu_batchnorm, gpu_batchnorm_graph, gpu_batchnorm_own) share:
//! one case's inputs, one run of training forward, backward and inference with every output
//! poisoned first and read back, and the checks against the f64 reference and between paths.

use cudarc::driver::CudaSlice;
use nnfuse::batchnorm::{
    BackwardArgs, BatchNorm, BnOptions, BnPath, Fuse, InferenceArgs, OwnVariant, OwnVariantChoice,
    TrainArgs,
};
use nnfuse::reference::activation::relu_mask_fwd;
use nnfuse::reference::batchnorm::{self as rb, Activation, ActivationBackward, BnShape};
use nnfuse::{Context, Element};

use super::{assert_close, assert_close_stored, f64s, poisoned, Rng};

pub const EPS: f64 = 1e-5;

/// Host copies of one case's inputs (already rounded to T, so the reference sees what the GPU
/// sees).
pub struct Inputs<T> {
    pub x: Vec<T>,
    /// The addend of Add+ReLU (unused by the other fusions).
    pub z: Vec<T>,
    /// The gradient entering the backward.
    pub dy: Vec<T>,
    pub gamma: Vec<f32>,
    pub beta: Vec<f32>,
    /// Running mean and variance before the forward (inference reads these).
    pub rm: Vec<f32>,
    pub rv: Vec<f32>,
}

impl<T: Element> Inputs<T> {
    /// `n` elements with x uniform in [-2, 3), `c` channels.
    pub fn uniform(rng: &mut Rng, n: usize, c: usize) -> Inputs<T> {
        let x = rng.vec(n, -2.0, 3.0);
        Inputs::with_x(rng, x, c)
    }

    /// `x` as given; the addend, the gradient and `c` channels' parameters drawn from `rng`.
    pub fn with_x(rng: &mut Rng, x: Vec<T>, c: usize) -> Inputs<T> {
        let n = x.len();
        Inputs {
            x,
            z: rng.vec(n, -1.0, 1.0),
            dy: rng.vec(n, -1.0, 1.0),
            gamma: rng.vec(c, 0.5, 1.5),
            beta: rng.vec(c, -0.5, 0.5),
            rm: rng.vec(c, -0.1, 0.1),
            rv: rng.vec(c, 0.5, 1.5),
        }
    }
}

/// Everything one GPU run produced, as f64.
#[derive(Debug, Clone)]
pub struct Outputs {
    pub path: BnPath,
    /// The training forward ran cuDNN's graph API.
    pub graph: bool,
    pub fwd_variant: Option<OwnVariant>,
    pub bwd_variant: Option<OwnVariant>,
    /// The training forward's y.
    pub y: Vec<f64>,
    /// Running mean and variance after the forward's update.
    pub rm: Vec<f64>,
    pub rv: Vec<f64>,
    pub saved_mean: Vec<f64>,
    pub saved_inv_std: Vec<f64>,
    /// The saved ReLU bitmask, where the path keeps one.
    pub mask: Option<Vec<u32>>,
    /// Bytes of cuDNN's ReLU mask the saved state held (the graph epilogue's), else 0.
    pub graph_mask_bytes: usize,
    pub dx: Vec<f64>,
    /// The addend's gradient (Add+ReLU only).
    pub dz: Option<Vec<f64>>,
    pub dgamma: Vec<f64>,
    pub dbeta: Vec<f64>,
    /// Inference with the running statistics of [`Inputs`].
    pub y_inference: Vec<f64>,
}

/// One case: how BatchNorm is called.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub fuse: Fuse,
    pub variant: OwnVariantChoice,
    /// Elements every data buffer is offset by (a view at an odd element takes the element path
    /// and never the persistent kernel).
    pub offset: usize,
    pub momentum: f64,
}

impl Run {
    /// `fuse` with the default options on whole buffers.
    pub fn plain(fuse: Fuse, momentum: f64) -> Run {
        Run {
            fuse,
            variant: OwnVariantChoice::Auto,
            offset: 0,
            momentum,
        }
    }
}

/// A device buffer holding `offset` poison elements, then `data`.
fn upload_at<T: Element>(ctx: &Context, data: &[T], offset: usize) -> CudaSlice<T> {
    let mut host = vec![T::from_f64(f64::NAN); offset];
    host.extend_from_slice(data);
    ctx.stream().clone_htod(&host).unwrap()
}

/// Training forward, backward and inference (with the original running statistics) of `r`
/// on `inp`, every output poisoned first.
pub fn run<T: Element>(
    ctx: &Context,
    shape: &[usize],
    axis: usize,
    r: Run,
    inp: &Inputs<T>,
) -> Outputs {
    let s = ctx.stream();
    let n = inp.x.len();
    let c = inp.gamma.len();
    let off = r.offset;
    let opts = BnOptions {
        own_variant: r.variant,
    };
    let bn = BatchNorm::<T>::with_options(ctx, shape, axis, r.fuse, opts).unwrap();
    let x = upload_at(ctx, &inp.x, off);
    let z = upload_at(ctx, &inp.z, off);
    let dy = upload_at(ctx, &inp.dy, off);
    let g = s.clone_htod(&inp.gamma).unwrap();
    let b = s.clone_htod(&inp.beta).unwrap();
    let mut rm = s.clone_htod(&inp.rm).unwrap();
    let mut rv = s.clone_htod(&inp.rv).unwrap();
    let mut y = poisoned::<T>(ctx, n + off);
    let add = r.fuse == Fuse::AddRelu;
    let saved = bn
        .forward_train(TrainArgs {
            x: x.slice(off..),
            addend: add.then(|| z.slice(off..)),
            gamma: g.as_view(),
            beta: b.as_view(),
            running_mean: rm.as_view_mut(),
            running_var: rv.as_view_mut(),
            y: y.slice_mut(off..),
            momentum: r.momentum,
            eps: EPS,
        })
        .unwrap();
    let (mut dx, mut dz) = (poisoned::<T>(ctx, n + off), poisoned::<T>(ctx, n + off));
    let (mut dg, mut db) = (poisoned::<f32>(ctx, c), poisoned::<f32>(ctx, c));
    bn.backward(BackwardArgs {
        x: x.slice(off..),
        y: y.slice(off..),
        dy: dy.slice(off..),
        gamma: g.as_view(),
        beta: b.as_view(),
        saved: &saved,
        dx: dx.slice_mut(off..),
        d_addend: add.then(|| dz.slice_mut(off..)),
        dgamma: dg.as_view_mut(),
        dbeta: db.as_view_mut(),
    })
    .unwrap();
    let rm0 = s.clone_htod(&inp.rm).unwrap();
    let rv0 = s.clone_htod(&inp.rv).unwrap();
    let mut yi = poisoned::<T>(ctx, n + off);
    bn.forward_inference(InferenceArgs {
        x: x.slice(off..),
        addend: add.then(|| z.slice(off..)),
        gamma: g.as_view(),
        beta: b.as_view(),
        running_mean: rm0.as_view(),
        running_var: rv0.as_view(),
        y: yi.slice_mut(off..),
        eps: EPS,
    })
    .unwrap();
    let h = |v: &CudaSlice<T>| f64s(&s.clone_dtoh(v).unwrap()[off..]);
    let h32 = |v: &CudaSlice<f32>| f64s(&s.clone_dtoh(v).unwrap());
    Outputs {
        path: saved.path(),
        graph: saved.ran_graph(),
        fwd_variant: saved.own_variant(),
        bwd_variant: bn.last_own_backward(),
        y: h(&y),
        rm: h32(&rm),
        rv: h32(&rv),
        saved_mean: h32(saved.saved_mean()),
        saved_inv_std: h32(saved.saved_inv_std()),
        mask: saved.mask().map(|m| s.clone_dtoh(m).unwrap()),
        graph_mask_bytes: saved.graph_mask_bytes(),
        dx: h(&dx),
        dz: add.then(|| h(&dz)),
        dgamma: h32(&dg),
        dbeta: h32(&db),
        y_inference: h(&yi),
    }
}

/// The reference forward's activation for `fuse` (`z`: the addend, as f64).
pub fn activation(fuse: Fuse, z: &[f64]) -> Activation<'_> {
    match fuse {
        Fuse::None => Activation::None,
        Fuse::Relu => Activation::Relu,
        Fuse::AddRelu => Activation::AddRelu(z),
    }
}

/// The reference backward's activation for `fuse` with ReLU mask `mask`.
pub fn activation_backward(fuse: Fuse, mask: &[u32]) -> ActivationBackward<'_> {
    match fuse {
        Fuse::None => ActivationBackward::None,
        Fuse::Relu => ActivationBackward::Relu { mask },
        Fuse::AddRelu => ActivationBackward::AddRelu { mask },
    }
}

/// y within `tol` of the reference forward `f`, the saved and running statistics within
/// `stats_tol` (`w` names each output).
pub fn check_forward(
    w: impl Fn(&str) -> String,
    out: &Outputs,
    f: &rb::BnForward,
    tol: f64,
    stats_tol: f64,
) {
    assert_close(&w("y"), &out.y, &f.y, tol);
    assert_close(&w("saved_mean"), &out.saved_mean, &f.saved_mean, stats_tol);
    assert_close(
        &w("saved_inv_std"),
        &out.saved_inv_std,
        &f.saved_inv_std,
        stats_tol,
    );
    assert_close(&w("running_mean"), &out.rm, &f.running_mean, stats_tol);
    assert_close(&w("running_var"), &out.rv, &f.running_var, stats_tol);
}

/// Checks one GPU run against the f64 reference. The activation mask of the reference backward
/// is taken from the GPU's own y (y > 0 exactly when the pre-activation was > 0), so that an
/// element whose pre-activation rounds across zero does not flip a whole gradient entry.
#[allow(clippy::too_many_arguments)]
pub fn check_against_reference<T: Element>(
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
    let act = activation(fuse, &z);
    let f = rb::train_forward(&sh, &x, &g, &b, &rm, &rv, momentum, EPS, act).unwrap();
    let w = |s: &str| format!("{what}: {s}");
    // Statistics are computed in f32 from exactly the inputs the reference sees.
    check_forward(w, out, &f, tol, 1e-5);
    let mask = relu_mask_fwd(&out.y).1;
    let act_bwd = activation_backward(fuse, &mask);
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

/// Two paths' ReLU masks (y > 0) on identical inputs agree except at a few kinks, where the
/// pre-activation is within rounding of zero (cuDNN's fused op adds the addend before rounding
/// to T, the fallback after, so an element an ulp from zero may land on either side). Returns
/// both paths' dx over the channels without a kink (a flip changes its channel's sums, dbeta
/// and dgamma, hence dx of the whole channel in proportion 1/M) and the number of kinks.
pub fn dx_away_from_kinks(
    what: &str,
    tol: f64,
    sh: &BnShape,
    a: &Outputs,
    b: &Outputs,
) -> (Vec<f64>, Vec<f64>, usize) {
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
    let channel = |i: usize| (i / sh.inner) % sh.c;
    let flipped: Vec<usize> = flips.iter().map(|&i| channel(i)).collect();
    let away = |v: &[f64]| -> Vec<f64> {
        v.iter()
            .enumerate()
            .filter(|(i, _)| !flipped.contains(&channel(*i)))
            .map(|(_, x)| *x)
            .collect()
    };
    (away(&a.dx), away(&b.dx), flips.len())
}
