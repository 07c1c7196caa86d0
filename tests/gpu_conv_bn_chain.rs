//! GPU tests of `block::ConvBnChain` (`conv → BN → ReLU → … → conv → BN (+ add) → ReLU`
//! trained as one chain, each inner BatchNorm + ReLU folded into the next convolution on the
//! prologue route): every route forced, then decided, for f16 (prologue and units), bf16 and
//! f32 (units; the prologue refused with its reason), against f64 — each convolution against
//! the f64 convolution of the f64 activation computed from the GPU's stored z before it, each
//! BatchNorm and gradient against the f64 references fed the GPU's stored z and dz — the two
//! routes against each other, the addend's gradient into dx or a buffer, an accumulating dx,
//! and the refusals. Fresh random inputs per run (the seed is printed), outputs NaN-poisoned.
//!
//! Run: `cargo test --test gpu_conv_bn_chain -- --ignored --nocapture --test-threads 1`.

mod common;

use half::{bf16, f16};
use nnfuse::batchnorm::Fuse;
use nnfuse::block::{AddendGrad, ChainArgs, ChainBackwardArgs, ChainBn, ChainRoute, ConvBnChain};
use nnfuse::conv::ConvShape;
use nnfuse::cudarc::driver::CudaSlice;
use nnfuse::reference::activation::relu_mask_fwd;
use nnfuse::reference::batchnorm::{self as rb, BnShape};
use nnfuse::reference::conv::{conv2d, conv2d_backward_data, conv2d_backward_filter};
use nnfuse::{Context, Element, Error, TensorFormat};

use common::bn::{activation, activation_backward, EPS};
use common::{
    assert_close, assert_close_stored, download, f64s, gpu, poisoned, rel_l2, upload, Rng,
};

/// The demo's bottleneck scaled down (n 2, 8x8), and a basic block (two 3x3), NHWC.
fn chains() -> Vec<(Vec<ConvShape>, Fuse)> {
    let s = |c_in, c_out, k| ConvShape::square(2, c_in, 8, c_out, k, TensorFormat::Nhwc);
    vec![
        (
            vec![s(256, 64, 1), s(64, 64, 3), s(64, 256, 1)],
            Fuse::AddRelu,
        ),
        (vec![s(64, 64, 3), s(64, 64, 3)], Fuse::Relu),
    ]
}

/// One case's host inputs (rounded to T).
struct Inputs<T> {
    x: Vec<T>,
    w: Vec<Vec<T>>,
    gamma: Vec<Vec<f32>>,
    beta: Vec<Vec<f32>>,
    rm: Vec<Vec<f32>>,
    rv: Vec<Vec<f32>>,
    addend: Vec<T>,
    dy: Vec<T>,
    dx0: Vec<T>,
}

impl<T: Element> Inputs<T> {
    fn new(rng: &mut Rng, shapes: &[ConvShape]) -> Inputs<T> {
        let last = shapes.last().unwrap();
        let yn = last.y_len().unwrap();
        let per_c = |rng: &mut Rng, lo, hi| -> Vec<Vec<f32>> {
            shapes.iter().map(|s| rng.vec(s.c_out, lo, hi)).collect()
        };
        Inputs {
            x: rng.vec(shapes[0].x_len().unwrap(), -1.0, 1.5),
            w: shapes
                .iter()
                .map(|s| rng.vec(s.w_len().unwrap(), -0.5, 0.5))
                .collect(),
            gamma: per_c(rng, 0.5, 1.5),
            beta: per_c(rng, -0.5, 0.5),
            rm: per_c(rng, -0.1, 0.1),
            rv: per_c(rng, 0.5, 1.5),
            addend: rng.vec(yn, -1.0, 1.0),
            dy: rng.vec(yn, -1.0, 1.0),
            dx0: rng.vec(shapes[0].x_len().unwrap(), -1.0, 1.0),
        }
    }
}

/// Everything one forward + backward wrote, as f64.
struct Out {
    route: ChainRoute,
    z: Vec<Vec<f64>>,
    dz: Vec<Vec<f64>>,
    y: Vec<f64>,
    rm: Vec<Vec<f64>>,
    rv: Vec<Vec<f64>>,
    dx: Vec<f64>,
    dw: Vec<Vec<f64>>,
    dgamma: Vec<Vec<f64>>,
    dbeta: Vec<Vec<f64>>,
    d_addend: Option<Vec<f64>>,
}

/// Where the addend's gradient goes and what dx holds before the backward.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Dx {
    /// dx overwritten; the addend's gradient into its own buffer.
    Plain,
    /// The addend's gradient into dx, the data gradient added onto it (addend = x).
    ShortcutX,
    /// dx holds dx0; the data gradient is added onto it.
    Accumulate,
}

/// One `ChainBn` per unit from its scale, bias and running statistics.
fn chain_bn<'a>(
    g: &'a [CudaSlice<f32>],
    b: &'a [CudaSlice<f32>],
    rm: &'a mut [CudaSlice<f32>],
    rv: &'a mut [CudaSlice<f32>],
) -> Vec<ChainBn<'a>> {
    g.iter()
        .zip(b)
        .zip(rm.iter_mut().zip(rv.iter_mut()))
        .map(|((g, b), (m, v))| ChainBn {
            gamma: g.as_view(),
            beta: b.as_view(),
            running_mean: m.as_view_mut(),
            running_var: v.as_view_mut(),
        })
        .collect()
}

/// Runs the chain once (`route`: forced, or None: decided).
fn run<T: Element>(
    ctx: &Context,
    chain: &ConvBnChain<T>,
    shapes: &[ConvShape],
    inp: &Inputs<T>,
    route: Option<ChainRoute>,
    dx_mode: Dx,
) -> nnfuse::Result<Out> {
    let n = shapes.len();
    let add = chain.plan().last == Fuse::AddRelu;
    let x = upload(ctx, &inp.x);
    let w: Vec<CudaSlice<T>> = inp.w.iter().map(|w| upload(ctx, w)).collect();
    let g: Vec<CudaSlice<f32>> = inp.gamma.iter().map(|v| upload(ctx, v)).collect();
    let b: Vec<CudaSlice<f32>> = inp.beta.iter().map(|v| upload(ctx, v)).collect();
    let mut rm: Vec<CudaSlice<f32>> = inp.rm.iter().map(|v| upload(ctx, v)).collect();
    let mut rv: Vec<CudaSlice<f32>> = inp.rv.iter().map(|v| upload(ctx, v)).collect();
    // With IntoDx the addend is x itself (an identity shortcut: shapes chosen so).
    let addend = if dx_mode == Dx::ShortcutX {
        upload(ctx, &inp.x)
    } else {
        upload(ctx, &inp.addend)
    };
    let dy = upload(ctx, &inp.dy);
    let yn = shapes[n - 1].y_len().unwrap();
    let mut y = poisoned::<T>(ctx, yn);
    let mut saved = chain.new_saved()?;
    let args = ChainArgs {
        x: x.as_view(),
        w: w.iter().map(|w| w.as_view()).collect(),
        bn: chain_bn(&g, &b, &mut rm, &mut rv),
        addend: add.then(|| addend.as_view()),
        y: y.as_view_mut(),
        momentum: 0.1,
        eps: EPS,
    };
    match route {
        Some(r) => chain.forward_train_with(r, args, &mut saved)?,
        None => chain.forward_train(args, &mut saved)?,
    }
    let mut dx: CudaSlice<T> = match dx_mode {
        Dx::Accumulate => upload(ctx, &inp.dx0),
        _ => poisoned::<T>(ctx, inp.x.len()),
    };
    let mut dw: Vec<CudaSlice<T>> = inp.w.iter().map(|w| poisoned::<T>(ctx, w.len())).collect();
    let mut dg: Vec<CudaSlice<f32>> = shapes.iter().map(|s| poisoned(ctx, s.c_out)).collect();
    let mut db: Vec<CudaSlice<f32>> = shapes.iter().map(|s| poisoned(ctx, s.c_out)).collect();
    let mut da = poisoned::<T>(ctx, yn);
    chain.backward(
        ChainBackwardArgs {
            x: x.as_view(),
            w: w.iter().map(|w| w.as_view()).collect(),
            gamma: g.iter().map(|v| v.as_view()).collect(),
            beta: b.iter().map(|v| v.as_view()).collect(),
            y: y.as_view(),
            dy: dy.as_view(),
            dx: Some(dx.as_view_mut()),
            accumulate_dx: dx_mode == Dx::Accumulate,
            dw: dw.iter_mut().map(|d| d.as_view_mut()).collect(),
            dgamma: dg.iter_mut().map(|d| d.as_view_mut()).collect(),
            dbeta: db.iter_mut().map(|d| d.as_view_mut()).collect(),
            d_addend: match (add, dx_mode) {
                (false, _) => AddendGrad::None,
                (true, Dx::ShortcutX) => AddendGrad::IntoDx,
                (true, _) => AddendGrad::Into(da.as_view_mut()),
            },
        },
        &mut saved,
    )?;
    let h = |v: &CudaSlice<T>| f64s(&download(ctx, v));
    let h32 = |v: &CudaSlice<f32>| f64s(&download(ctx, v));
    let hv = |v: nnfuse::cudarc::driver::CudaView<'_, T>| {
        let mut out = vec![T::from_f64(0.0); v.len()];
        ctx.stream().memcpy_dtoh(&v, &mut out).unwrap();
        f64s(&out)
    };
    Ok(Out {
        route: saved.route().unwrap(),
        z: (0..n).map(|i| hv(saved.z(i).unwrap())).collect(),
        dz: (0..n).map(|i| hv(saved.dz(i).unwrap())).collect(),
        y: h(&y),
        rm: rm.iter().map(h32).collect(),
        rv: rv.iter().map(h32).collect(),
        dx: h(&dx),
        dw: dw.iter().map(h).collect(),
        dgamma: dg.iter().map(h32).collect(),
        dbeta: db.iter().map(h32).collect(),
        d_addend: (add && dx_mode != Dx::ShortcutX).then(|| h(&da)),
    })
}

/// The unit roundoff of T (half the distance from 1 to the next value).
fn unit_roundoff(dt: nnfuse::DType) -> f64 {
    match dt {
        nnfuse::DType::F32 => 2f64.powi(-24),
        nnfuse::DType::F16 => 2f64.powi(-11),
        nnfuse::DType::BF16 => 2f64.powi(-8),
    }
}

/// What ReLU masks flipped by rounding may add to an inner unit's dz. The GPU's mask comes from
/// its own activation (the prologue route: `relu(z · scale + bias)` with the scale and bias in
/// T), the reference's from the f64 one: an element whose f64 pre-activation lies within the
/// rounding of that expression, `4u (|scale · z| + |bias|)`, may take either side. A flip at
/// element k changes dz_k by `γ · inv_std · dy_k`, and its channel's two sums by `dy_k` and
/// `dy_k · x̂_k`, which moves each of the channel's M gradients by at most
/// `γ · inv_std · |dy_k| (1 + |x̂_j x̂_k|) / M` — `(1 + |x̂_k| max|x̂|) / √M` in L2 over the
/// channel. The bound adds these over the ambiguous elements only (a wrong mask elsewhere, or
/// any other error, still fails); per channel, such an element moves dβ by at most `|dy_k|` and
/// dγ by `|dy_k x̂_k|`.
struct FlipBound {
    /// Elements within rounding of the ReLU's threshold.
    ambiguous: usize,
    /// Their summed worst-case L2 contribution to dz.
    allowance: f64,
    /// Per channel: their summed `|dy_k|`.
    dbeta: Vec<f64>,
    /// Per channel: their summed `|dy_k x̂_k|`.
    dgamma: Vec<f64>,
}

impl FlipBound {
    fn new(
        dt: nnfuse::DType,
        z: &[f64],
        dy: &[f64],
        gamma: &[f64],
        beta: &[f64],
        mean: &[f64],
        inv_std: &[f64],
    ) -> Self {
        let c = gamma.len();
        let m = (z.len() / c) as f64;
        let u = unit_roundoff(dt);
        let mut xhat_max = vec![0.0f64; c];
        for (k, &zk) in z.iter().enumerate() {
            let ch = k % c;
            xhat_max[ch] = xhat_max[ch].max(((zk - mean[ch]) * inv_std[ch]).abs());
        }
        let (mut ambiguous, mut allowance) = (0, 0.0);
        let (mut dbeta, mut dgamma) = (vec![0.0; c], vec![0.0; c]);
        for (k, &zk) in z.iter().enumerate() {
            let ch = k % c;
            let scale = gamma[ch] * inv_std[ch];
            let bias = beta[ch] - mean[ch] * scale;
            let pre = zk * scale + bias;
            if pre.abs() <= 4.0 * u * ((zk * scale).abs() + bias.abs()) {
                let xhat = (zk - mean[ch]) * inv_std[ch];
                ambiguous += 1;
                allowance +=
                    (scale * dy[k]).abs() * (1.0 + (1.0 + xhat.abs() * xhat_max[ch]) / m.sqrt());
                dbeta[ch] += dy[k].abs();
                dgamma[ch] += (dy[k] * xhat).abs();
            }
        }
        FlipBound {
            ambiguous,
            allowance,
            dbeta,
            dgamma,
        }
    }

    /// [`common::assert_close_stored`] with the flips' allowance added to the error's L2 norm.
    fn assert_close(&self, what: &str, dt: nnfuse::DType, got: &[f64], want: &[f64], tol: f64) {
        let norm = want.iter().map(|w| w * w).sum::<f64>().sqrt().max(1e-300);
        let diff = got
            .iter()
            .zip(want)
            .map(|(g, w)| (g - w) * (g - w))
            .sum::<f64>()
            .sqrt();
        let floor = common::half_subnormal_step(dt) * (want.len() as f64).sqrt();
        let bound = tol * norm + floor + self.allowance;
        assert!(
            got.iter().all(|v| v.is_finite()) && diff <= bound,
            "{what}: L2 error {diff:.3e} (relative {:.3e}) > {bound:.3e}: tolerance {tol:.1e} of \
             the norm {norm:.3e} plus {:.3e} for {} element(s) within rounding of the ReLU's \
             threshold",
            diff / norm,
            self.allowance,
            self.ambiguous
        );
    }
}

fn bn_shape(s: &ConvShape) -> BnShape {
    let (oh, ow) = s.out_hw().unwrap();
    BnShape::new(&[s.n, oh, ow, s.c_out], 3).unwrap()
}

/// Every output of `got` against f64 (see the module docs).
fn check<T: Element>(
    what: &str,
    shapes: &[ConvShape],
    last: Fuse,
    inp: &Inputs<T>,
    got: &Out,
    mode: Dx,
) {
    let n = shapes.len();
    let dt = T::DTYPE;
    let tol = dt.tolerance();
    let w = |i: usize, s: &str| format!("{what}: unit {i} {s}");
    let addend = if mode == Dx::ShortcutX {
        f64s(&inp.x)
    } else {
        f64s(&inp.addend)
    };
    // Forward: each unit's input is the f64 activation of the stored z before it.
    let mut input = f64s(&inp.x);
    let mut fwd = Vec::new();
    for (i, s) in shapes.iter().enumerate() {
        let z_ref = conv2d(s, &input, &f64s(&inp.w[i])).unwrap();
        assert_close(&w(i, "z"), &got.z[i], &z_ref, tol);
        let fuse = if i + 1 == n { last } else { Fuse::Relu };
        let f = rb::train_forward(
            &bn_shape(s),
            &got.z[i],
            &f64s(&inp.gamma[i]),
            &f64s(&inp.beta[i]),
            &f64s(&inp.rm[i]),
            &f64s(&inp.rv[i]),
            0.1,
            EPS,
            activation(fuse, &addend),
        )
        .unwrap();
        assert_close(
            &w(i, "running_mean"),
            &got.rm[i],
            &f.running_mean,
            tol.max(1e-5),
        );
        assert_close(
            &w(i, "running_var"),
            &got.rv[i],
            &f.running_var,
            tol.max(1e-5),
        );
        input = f.y.clone();
        fwd.push(f);
    }
    assert_close(&format!("{what}: y"), &got.y, &fwd[n - 1].y, tol);
    // Backward: each BatchNorm's from the stored dz after it.
    for i in (0..n).rev() {
        let s = &shapes[i];
        let (dy, fuse) = if i + 1 == n {
            (f64s(&inp.dy), last)
        } else {
            let next = &shapes[i + 1];
            (
                conv2d_backward_data(next, &got.dz[i + 1], &f64s(&inp.w[i + 1])).unwrap(),
                Fuse::Relu,
            )
        };
        // The mask from the f64 activation (the GPU never stores the inner ones): an element
        // within rounding of zero may flip, which moves its channel's gradient by ~1/M.
        let y_act = if i + 1 == n {
            got.y.clone()
        } else {
            fwd[i].y.clone()
        };
        let mask = relu_mask_fwd(&y_act).1;
        let gr = rb::backward(
            &bn_shape(s),
            &got.z[i],
            &dy,
            &f64s(&inp.gamma[i]),
            &fwd[i].saved_mean,
            &fwd[i].saved_inv_std,
            activation_backward(fuse, &mask),
        )
        .unwrap();
        if i + 1 == n {
            assert_close_stored(&w(i, "dz"), dt, &got.dz[i], &gr.dx, tol);
            assert_close(&w(i, "dgamma"), &got.dgamma[i], &gr.dgamma, tol.max(1e-5));
            assert_close(&w(i, "dbeta"), &got.dbeta[i], &gr.dbeta, tol.max(1e-5));
        } else {
            let flips = FlipBound::new(
                dt,
                &got.z[i],
                &dy,
                &f64s(&inp.gamma[i]),
                &f64s(&inp.beta[i]),
                &fwd[i].saved_mean,
                &fwd[i].saved_inv_std,
            );
            flips.assert_close(&w(i, "dz"), dt, &got.dz[i], &gr.dx, tol);
            // An inner BatchNorm's gradient comes from a gradient the GPU stored in T and the
            // test cannot see (the units route's activation gradient, the prologue route's
            // gradient after the ReLU): each term of dβ = Σ dy and dγ = Σ dy·x̂ carries that
            // rounding, and a channel's sum may cancel far below its terms. Bound each channel
            // by the rounding of its terms, plus the terms a flipped mask may add or drop.
            let (mut abs_b, mut abs_g) = (vec![0.0; s.c_out], vec![0.0; s.c_out]);
            for (k, d) in dy.iter().enumerate() {
                let c = k % s.c_out;
                if y_act[k] > 0.0 {
                    let xhat = (got.z[i][k] - fwd[i].saved_mean[c]) * fwd[i].saved_inv_std[c];
                    abs_b[c] += d.abs();
                    abs_g[c] += (d * xhat).abs();
                }
            }
            let u = unit_roundoff(dt);
            for (name, g, r, a) in [
                ("dgamma", &got.dgamma[i], &gr.dgamma, &abs_g),
                ("dbeta", &got.dbeta[i], &gr.dbeta, &abs_b),
            ] {
                let flip = if name == "dbeta" {
                    &flips.dbeta
                } else {
                    &flips.dgamma
                };
                for c in 0..s.c_out {
                    let bound = 4.0 * u * a[c] + flip[c] + 1e-6 * r[c].abs() + 1e-9;
                    assert!(
                        (g[c] - r[c]).abs() <= bound,
                        "{}: channel {c}: {} against {} (bound {bound:.2e}: 4u of the terms' \
                         absolute sum {:.3e}, plus {:.3e} for the channel's elements within \
                         rounding of the ReLU's threshold)",
                        w(i, name),
                        g[c],
                        r[c],
                        a[c],
                        flip[c]
                    );
                }
            }
        }
        let x_in = if i == 0 {
            f64s(&inp.x)
        } else {
            fwd[i - 1].y.clone()
        };
        let dw_ref = conv2d_backward_filter(s, &x_in, &got.dz[i]).unwrap();
        assert_close(&w(i, "dw"), &got.dw[i], &dw_ref, tol);
        if i + 1 == n {
            if let (Some(d), Some(want)) = (&got.d_addend, &gr.d_addend) {
                assert_close(&w(i, "d_addend"), d, want, tol);
            }
        }
    }
    let mut dx_ref = conv2d_backward_data(&shapes[0], &got.dz[0], &f64s(&inp.w[0])).unwrap();
    match mode {
        Dx::Accumulate => {
            for (r, a) in dx_ref.iter_mut().zip(f64s(&inp.dx0)) {
                *r += a;
            }
        }
        Dx::ShortcutX => {
            // The addend's gradient: dz of the last unit's BatchNorm output before the ReLU.
            let mask = relu_mask_fwd(&got.y).1;
            let gr = rb::backward(
                &bn_shape(&shapes[n - 1]),
                &got.z[n - 1],
                &f64s(&inp.dy),
                &f64s(&inp.gamma[n - 1]),
                &fwd[n - 1].saved_mean,
                &fwd[n - 1].saved_inv_std,
                activation_backward(last, &mask),
            )
            .unwrap();
            for (r, a) in dx_ref.iter_mut().zip(gr.d_addend.unwrap()) {
                *r += a;
            }
        }
        Dx::Plain => {}
    }
    assert_close(&format!("{what}: dx"), &got.dx, &dx_ref, tol);
}

/// The chain in f64 from its inputs alone (no stored intermediate): y and dx (dx overwritten,
/// the addend's gradient into its own buffer).
fn end_to_end<T: Element>(
    shapes: &[ConvShape],
    last: Fuse,
    inp: &Inputs<T>,
) -> (Vec<f64>, Vec<f64>) {
    let n = shapes.len();
    let addend = f64s(&inp.addend);
    let mut input = f64s(&inp.x);
    let (mut zs, mut fwd) = (Vec::new(), Vec::new());
    for (i, s) in shapes.iter().enumerate() {
        let z = conv2d(s, &input, &f64s(&inp.w[i])).unwrap();
        let fuse = if i + 1 == n { last } else { Fuse::Relu };
        let f = rb::train_forward(
            &bn_shape(s),
            &z,
            &f64s(&inp.gamma[i]),
            &f64s(&inp.beta[i]),
            &f64s(&inp.rm[i]),
            &f64s(&inp.rv[i]),
            0.1,
            EPS,
            activation(fuse, &addend),
        )
        .unwrap();
        input = f.y.clone();
        zs.push(z);
        fwd.push(f);
    }
    let mut dy = f64s(&inp.dy);
    for i in (0..n).rev() {
        let fuse = if i + 1 == n { last } else { Fuse::Relu };
        let mask = relu_mask_fwd(&fwd[i].y).1;
        let gr = rb::backward(
            &bn_shape(&shapes[i]),
            &zs[i],
            &dy,
            &f64s(&inp.gamma[i]),
            &fwd[i].saved_mean,
            &fwd[i].saved_inv_std,
            activation_backward(fuse, &mask),
        )
        .unwrap();
        dy = conv2d_backward_data(&shapes[i], &gr.dx, &f64s(&inp.w[i])).unwrap();
    }
    (fwd[n - 1].y.clone(), dy)
}

fn chain_case<T: Element>(ctx: &Context, shapes: Vec<ConvShape>, last: Fuse) {
    let what = format!("{} {} units {}", T::DTYPE.name(), shapes.len(), last.name());
    let mut rng = Rng::fresh(&what);
    let inp = Inputs::<T>::new(&mut rng, &shapes);
    let chain = ConvBnChain::<T>::new(ctx, &shapes, last).unwrap();
    print!("{}", chain.plan());
    let identity = shapes[0].x_len().unwrap() == shapes[shapes.len() - 1].y_len().unwrap()
        && last == Fuse::AddRelu;
    let mut outs = Vec::new();
    for r in ChainRoute::ALL {
        if !chain.plan().eligible(r) {
            match run(ctx, &chain, &shapes, &inp, Some(r), Dx::Plain).err() {
                Some(Error::NotSupported(why)) => {
                    assert!(why.contains(chain.plan().reason(r)), "{what}: {why}");
                    println!("  {r}: refused: {why}");
                }
                other => panic!("{what}: forced {r} on a refused route gave {other:?}"),
            }
            continue;
        }
        for mode in [Dx::Plain, Dx::Accumulate] {
            let got = run(ctx, &chain, &shapes, &inp, Some(r), mode).unwrap();
            assert_eq!(got.route, r);
            check(
                &format!("{what} {r} {mode:?}"),
                &shapes,
                last,
                &inp,
                &got,
                mode,
            );
            if mode == Dx::Plain {
                outs.push(got);
            }
        }
        if identity {
            let got = run(ctx, &chain, &shapes, &inp, Some(r), Dx::ShortcutX).unwrap();
            check(
                &format!("{what} {r} IntoDx"),
                &shapes,
                last,
                &inp,
                &got,
                Dx::ShortcutX,
            );
        }
    }
    if T::DTYPE == nnfuse::DType::F16 {
        assert!(
            chain.plan().eligible(ChainRoute::Prologue),
            "{what}: f16 NHWC takes the prologue route: {}",
            chain.plan()
        );
    }
    // End to end against f64 (errors of every unit add up): each route's, and the routes
    // against each other, within the first call's bound (ten times the type's tolerance).
    let (y64, dx64) = end_to_end(shapes.as_slice(), last, &inp);
    for o in &outs {
        println!(
            "  {} end to end against f64: y {:.2e}, dx {:.2e}",
            o.route,
            rel_l2(&o.y, &y64),
            rel_l2(&o.dx, &dx64)
        );
    }
    if outs.len() == 2 {
        let tol = T::DTYPE.tolerance();
        assert_close(
            &format!("{what}: prologue y vs units"),
            &outs[0].y,
            &outs[1].y,
            tol,
        );
        assert_close(
            &format!("{what}: prologue dx vs units"),
            &outs[0].dx,
            &outs[1].dx,
            10.0 * tol,
        );
        // End to end the data gradient is 1.3e-2 to 3.1e-2 from f64 on the units route and
        // 1.6e-2 to 6.2e-2 on the prologue route over seven seeds (H100): the prologue's forward
        // applies the scale and bias rounded to T while its backward recomputes the ReLU's mask
        // from the f32 statistics, so elements within rounding of zero may be masked
        // differently. Both within the first call's bound.
        let (ep, eu) = (rel_l2(&outs[0].dx, &dx64), rel_l2(&outs[1].dx, &dx64));
        assert!(
            ep <= 10.0 * tol && eu <= 10.0 * tol,
            "{what}: dx from f64 end to end: prologue {ep:.2e}, units {eu:.2e}"
        );
    }
    assert!(chain.choice().is_none(), "{what}: forced calls decided");
    let got = run(ctx, &chain, &shapes, &inp, None, Dx::Plain).unwrap();
    let choice = chain.choice().expect("the first forward_train decides");
    println!("  decided: {}", choice.describe());
    for n in &choice.notes {
        println!("    {n}");
    }
    assert_eq!(
        got.route,
        ChainRoute::Units,
        "the first call's result is the units route's"
    );
    check(
        &format!("{what} first call"),
        &shapes,
        last,
        &inp,
        &got,
        Dx::Plain,
    );
    if chain.plan().eligible(ChainRoute::Prologue) {
        assert!(
            choice
                .notes
                .iter()
                .any(|n| n.contains("matches the units route")),
            "{what}: the prologue route was not checked: {:?}",
            choice.notes
        );
        assert_eq!(
            choice.times_us.len(),
            2,
            "{what}: both routes timed: {choice:?}"
        );
    } else {
        assert_eq!(choice.route, ChainRoute::Units);
    }
    let later = run(ctx, &chain, &shapes, &inp, None, Dx::Plain).unwrap();
    assert_eq!(
        later.route, choice.route,
        "{what}: later calls take the decision"
    );
    check(
        &format!("{what} decided"),
        &shapes,
        last,
        &inp,
        &later,
        Dx::Plain,
    );
}

fn all<T: Element>() {
    let ctx = gpu();
    for (shapes, last) in chains() {
        chain_case::<T>(&ctx, shapes, last);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn conv_bn_chain_f16_every_route_matches_f64() {
    all::<f16>();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn conv_bn_chain_bf16_matches_f64() {
    all::<bf16>();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn conv_bn_chain_f32_matches_f64() {
    all::<f32>();
}

/// Wrong counts, another chain's state, a missing addend, a backward before any forward and
/// IntoDx with accumulate: errors naming the argument, nothing decided.
#[test]
#[ignore = "needs a CUDA GPU"]
fn conv_bn_chain_names_bad_arguments() {
    let ctx = gpu();
    let (shapes, last) = chains().remove(0);
    let a = ConvBnChain::<f16>::new(&ctx, &shapes, last).unwrap();
    let b = ConvBnChain::<f16>::new(&ctx, &shapes, last).unwrap();
    let e = ConvBnChain::<f16>::new(&ctx, &shapes[..1], last).unwrap_err();
    assert_eq!(e.argument(), Some("shapes"), "{e}");
    let mut rng = Rng::fresh("chain bad");
    let inp = Inputs::<f16>::new(&mut rng, &shapes);
    let x = upload(&ctx, &inp.x);
    let w: Vec<CudaSlice<f16>> = inp.w.iter().map(|w| upload(&ctx, w)).collect();
    let g: Vec<CudaSlice<f32>> = inp.gamma.iter().map(|v| upload(&ctx, v)).collect();
    let mut rm: Vec<CudaSlice<f32>> = inp.rm.iter().map(|v| upload(&ctx, v)).collect();
    let mut rv: Vec<CudaSlice<f32>> = inp.rv.iter().map(|v| upload(&ctx, v)).collect();
    let addend = upload(&ctx, &inp.addend);
    let mut y = poisoned::<f16>(&ctx, shapes[2].y_len().unwrap());
    let mut saved_b = b.new_saved().unwrap();
    let mut saved_a = a.new_saved().unwrap();
    macro_rules! args {
        ($nw:expr, $with_addend:expr) => {
            ChainArgs {
                x: x.as_view(),
                w: w.iter().take($nw).map(|w| w.as_view()).collect(),
                bn: chain_bn(&g, &g, &mut rm, &mut rv),
                addend: $with_addend.then(|| addend.as_view()),
                y: y.as_view_mut(),
                momentum: 0.1,
                eps: EPS,
            }
        };
    }
    let e = a.forward_train(args!(2, true), &mut saved_a).unwrap_err();
    assert_eq!(e.argument(), Some("w"), "{e}");
    let e = a.forward_train(args!(3, true), &mut saved_b).unwrap_err();
    assert_eq!(e.argument(), Some("saved"), "{e}");
    let e = a.forward_train(args!(3, false), &mut saved_a).unwrap_err();
    assert_eq!(e.argument(), Some("addend"), "{e}");
    assert!(a.choice().is_none(), "a refused call decided nothing");
    let dy = upload(&ctx, &inp.dy);
    let mut dx = poisoned::<f16>(&ctx, inp.x.len());
    let mut dw: Vec<CudaSlice<f16>> = inp.w.iter().map(|w| poisoned(&ctx, w.len())).collect();
    let mut dg: Vec<CudaSlice<f32>> = shapes.iter().map(|s| poisoned(&ctx, s.c_out)).collect();
    let mut db: Vec<CudaSlice<f32>> = shapes.iter().map(|s| poisoned(&ctx, s.c_out)).collect();
    let y2 = poisoned::<f16>(&ctx, shapes[2].y_len().unwrap());
    macro_rules! bwd {
        ($accumulate:expr, $d_addend:expr) => {
            ChainBackwardArgs {
                x: x.as_view(),
                w: w.iter().map(|w| w.as_view()).collect(),
                gamma: g.iter().map(|v| v.as_view()).collect(),
                beta: g.iter().map(|v| v.as_view()).collect(),
                y: y2.as_view(),
                dy: dy.as_view(),
                dx: Some(dx.as_view_mut()),
                accumulate_dx: $accumulate,
                dw: dw.iter_mut().map(|d| d.as_view_mut()).collect(),
                dgamma: dg.iter_mut().map(|d| d.as_view_mut()).collect(),
                dbeta: db.iter_mut().map(|d| d.as_view_mut()).collect(),
                d_addend: $d_addend,
            }
        };
    }
    let e = a
        .backward(bwd!(false, AddendGrad::IntoDx), &mut saved_a)
        .unwrap_err();
    assert_eq!(e.argument(), Some("saved"), "{e}");
    let e = a
        .backward(bwd!(true, AddendGrad::IntoDx), &mut saved_a)
        .unwrap_err();
    assert_eq!(e.argument(), Some("accumulate_dx"), "{e}");
    let e = a
        .backward(bwd!(false, AddendGrad::None), &mut saved_a)
        .unwrap_err();
    assert_eq!(e.argument(), Some("d_addend"), "{e}");
}

/// A filter that is not 16-byte aligned (a view two bytes into its buffer) sends a forced
/// prologue call to the units route for that call, before anything runs; the backward follows
/// and every output still matches f64.
#[test]
#[ignore = "needs a CUDA GPU"]
fn conv_bn_chain_misaligned_filter_takes_the_units_route() {
    let ctx = gpu();
    let (shapes, last) = chains().remove(0);
    let chain = ConvBnChain::<f16>::new(&ctx, &shapes, last).unwrap();
    if !chain.plan().eligible(ChainRoute::Prologue) {
        println!("prologue refused here: {}", chain.plan());
        return;
    }
    let mut rng = Rng::fresh("chain misaligned");
    let inp = Inputs::<f16>::new(&mut rng, &shapes);
    let x = upload(&ctx, &inp.x);
    // w[1] one element into a longer buffer.
    let mut w1 = vec![f16::from_f64(0.0)];
    w1.extend_from_slice(&inp.w[1]);
    let w1 = upload(&ctx, &w1);
    let w: Vec<CudaSlice<f16>> = inp.w.iter().map(|w| upload(&ctx, w)).collect();
    let g: Vec<CudaSlice<f32>> = inp.gamma.iter().map(|v| upload(&ctx, v)).collect();
    let b: Vec<CudaSlice<f32>> = inp.beta.iter().map(|v| upload(&ctx, v)).collect();
    let mut rm: Vec<CudaSlice<f32>> = inp.rm.iter().map(|v| upload(&ctx, v)).collect();
    let mut rv: Vec<CudaSlice<f32>> = inp.rv.iter().map(|v| upload(&ctx, v)).collect();
    let addend = upload(&ctx, &inp.addend);
    let mut y = poisoned::<f16>(&ctx, shapes[2].y_len().unwrap());
    let mut saved = chain.new_saved().unwrap();
    let views = vec![w[0].as_view(), w1.slice(1..), w[2].as_view()];
    chain
        .forward_train_with(
            ChainRoute::Prologue,
            ChainArgs {
                x: x.as_view(),
                w: views,
                bn: chain_bn(&g, &b, &mut rm, &mut rv),
                addend: Some(addend.as_view()),
                y: y.as_view_mut(),
                momentum: 0.1,
                eps: EPS,
            },
            &mut saved,
        )
        .unwrap();
    assert_eq!(saved.route(), Some(ChainRoute::Units));
    // y against the same chain run forced to the units route with aligned filters.
    let want = run(
        &ctx,
        &chain,
        &shapes,
        &inp,
        Some(ChainRoute::Units),
        Dx::Plain,
    )
    .unwrap();
    assert_close(
        "misaligned filter: y against the aligned units run",
        &f64s(&download(&ctx, &y)),
        &want.y,
        f16::DTYPE.tolerance(),
    );
}
