//! f64 references of the demo's operations that the library does not ship yet, on every core:
//! the convolution's forward and both gradients (any stride, padding, dilation; NCHW/KCRS and
//! NHWC/KRSC) and the classifier's three GEMMs in row-major form; plus the comparison the check
//! prints. Pure: no GPU. The convolutions are checked against `nnfuse::reference::conv::conv2d`
//! and, for the gradients, by the adjoint identity and finite differences (tests below).
//!
//! Internally every convolution runs channels-last (x `[n][h][w][c]`, filter `[k][r][s][c]`),
//! so that the innermost loop walks contiguous channels; NCHW operands are permuted in and out.

use nnfuse::conv::ConvShape;
use nnfuse::TensorFormat;

/// `f(i)` for `i` in `0..n` on every core; the results in order.
pub fn par_map<O: Send>(n: usize, f: impl Fn(usize) -> O + Sync) -> Vec<O> {
    let threads = std::thread::available_parallelism().map_or(4, |t| t.get());
    let chunk = n.div_ceil(threads).max(1);
    let f = &f;
    std::thread::scope(|sc| {
        let handles: Vec<_> = (0..n)
            .step_by(chunk)
            .map(|start| {
                sc.spawn(move || (start..(start + chunk).min(n)).map(f).collect::<Vec<O>>())
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| match h.join() {
                Ok(v) => v,
                Err(p) => std::panic::resume_unwind(p),
            })
            .collect()
    })
}

/// The problem's sizes, channels-last.
#[derive(Debug, Clone, Copy)]
struct Dims {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    k: usize,
    r: usize,
    s: usize,
    oh: usize,
    ow: usize,
    stride: (usize, usize),
    pad: (usize, usize),
    dil: (usize, usize),
}

impl Dims {
    fn of(p: &ConvShape) -> Dims {
        let (oh, ow) = p.out_hw().expect("the demo's convolutions are valid");
        Dims {
            n: p.n,
            c: p.c_in,
            h: p.h,
            w: p.w,
            k: p.c_out,
            r: p.kh,
            s: p.kw,
            oh,
            ow,
            stride: p.stride,
            pad: p.pad,
            dil: p.dilation,
        }
    }

    /// Input row/column under tap `t` of output `o` along one axis, if inside the input.
    fn tap(
        o: usize,
        t: usize,
        stride: usize,
        dil: usize,
        pad: usize,
        extent: usize,
    ) -> Option<usize> {
        (o * stride + t * dil)
            .checked_sub(pad)
            .filter(|&i| i < extent)
    }
}

/// `[n][c][h][w]` → `[n][h][w][c]`.
fn nchw_to_nhwc(v: &[f64], n: usize, c: usize, hw: usize) -> Vec<f64> {
    let mut out = vec![0.0; v.len()];
    for b in 0..n {
        for ch in 0..c {
            for p in 0..hw {
                out[(b * hw + p) * c + ch] = v[(b * c + ch) * hw + p];
            }
        }
    }
    out
}

/// `[n][h][w][c]` → `[n][c][h][w]`.
fn nhwc_to_nchw(v: &[f64], n: usize, c: usize, hw: usize) -> Vec<f64> {
    let mut out = vec![0.0; v.len()];
    for b in 0..n {
        for p in 0..hw {
            for ch in 0..c {
                out[(b * c + ch) * hw + p] = v[(b * hw + p) * c + ch];
            }
        }
    }
    out
}

/// An activation in the problem's format, channels-last.
fn act_in(p: &ConvShape, v: &[f64], c: usize, hw: usize) -> Vec<f64> {
    match p.format {
        TensorFormat::Nhwc => v.to_vec(),
        TensorFormat::Nchw => nchw_to_nhwc(v, p.n, c, hw),
    }
}

/// A channels-last activation in the problem's format.
fn act_out(p: &ConvShape, v: Vec<f64>, c: usize, hw: usize) -> Vec<f64> {
    match p.format {
        TensorFormat::Nhwc => v,
        TensorFormat::Nchw => nhwc_to_nchw(&v, p.n, c, hw),
    }
}

/// The filter as KRSC (KCRS is `[k][c][rs]`, i.e. NCHW-shaped with n = k; KRSC is its NHWC).
fn filter_in(p: &ConvShape, w: &[f64]) -> Vec<f64> {
    match p.format {
        TensorFormat::Nhwc => w.to_vec(),
        TensorFormat::Nchw => nchw_to_nhwc(w, p.c_out, p.c_in, p.kh * p.kw),
    }
}

fn filter_out(p: &ConvShape, w: Vec<f64>) -> Vec<f64> {
    match p.format {
        TensorFormat::Nhwc => w,
        TensorFormat::Nchw => nhwc_to_nchw(&w, p.c_out, p.c_in, p.kh * p.kw),
    }
}

/// `y = conv(x, w)` (cross-correlation, layouts as `nnfuse::reference::conv`).
pub fn conv_forward(p: &ConvShape, x: &[f64], w: &[f64]) -> Vec<f64> {
    let d = Dims::of(p);
    assert_eq!(Some(x.len()), p.x_len().ok(), "x");
    assert_eq!(Some(w.len()), p.w_len().ok(), "w");
    let x = act_in(p, x, d.c, d.h * d.w);
    let w = filter_in(p, w);
    // One task per output row (b, oy): ow * k outputs, contiguous channels-last.
    let rows = par_map(d.n * d.oh, |row| {
        let (b, oy) = (row / d.oh, row % d.oh);
        let mut out = vec![0.0; d.ow * d.k];
        for ox in 0..d.ow {
            for r in 0..d.r {
                let Some(iy) = Dims::tap(oy, r, d.stride.0, d.dil.0, d.pad.0, d.h) else {
                    continue;
                };
                for s in 0..d.s {
                    let Some(ix) = Dims::tap(ox, s, d.stride.1, d.dil.1, d.pad.1, d.w) else {
                        continue;
                    };
                    let xs = &x[((b * d.h + iy) * d.w + ix) * d.c..][..d.c];
                    for k in 0..d.k {
                        let ws = &w[((k * d.r + r) * d.s + s) * d.c..][..d.c];
                        out[ox * d.k + k] += xs.iter().zip(ws).map(|(a, b)| a * b).sum::<f64>();
                    }
                }
            }
        }
        out
    });
    act_out(p, rows.concat(), d.k, d.oh * d.ow)
}

/// `dx` from `dy` and `w`: every input element gathers the output gradients whose taps read it.
pub fn conv_backward_data(p: &ConvShape, dy: &[f64], w: &[f64]) -> Vec<f64> {
    let d = Dims::of(p);
    assert_eq!(dy.len(), d.n * d.k * d.oh * d.ow, "dy");
    assert_eq!(Some(w.len()), p.w_len().ok(), "w");
    let dy = act_in(p, dy, d.k, d.oh * d.ow);
    let w = filter_in(p, w);
    // Output position along one axis whose tap `t` reads input `i`, if any.
    let back = |i: usize, t: usize, stride: usize, dil: usize, pad: usize, extent: usize| {
        (i + pad)
            .checked_sub(t * dil)
            .filter(|v| v % stride == 0)
            .map(|v| v / stride)
            .filter(|&o| o < extent)
    };
    let rows = par_map(d.n * d.h, |row| {
        let (b, iy) = (row / d.h, row % d.h);
        let mut out = vec![0.0; d.w * d.c];
        for ix in 0..d.w {
            let acc = &mut out[ix * d.c..][..d.c];
            for r in 0..d.r {
                let Some(oy) = back(iy, r, d.stride.0, d.dil.0, d.pad.0, d.oh) else {
                    continue;
                };
                for s in 0..d.s {
                    let Some(ox) = back(ix, s, d.stride.1, d.dil.1, d.pad.1, d.ow) else {
                        continue;
                    };
                    let g = &dy[((b * d.oh + oy) * d.ow + ox) * d.k..][..d.k];
                    for (k, &gk) in g.iter().enumerate() {
                        let ws = &w[((k * d.r + r) * d.s + s) * d.c..][..d.c];
                        for (a, wv) in acc.iter_mut().zip(ws) {
                            *a += gk * wv;
                        }
                    }
                }
            }
        }
        out
    });
    act_out(p, rows.concat(), d.c, d.h * d.w)
}

/// `dw` from `x` and `dy`: every filter tap sums input times output gradient over the batch and
/// the output pixels.
pub fn conv_backward_filter(p: &ConvShape, x: &[f64], dy: &[f64]) -> Vec<f64> {
    let d = Dims::of(p);
    assert_eq!(Some(x.len()), p.x_len().ok(), "x");
    assert_eq!(dy.len(), d.n * d.k * d.oh * d.ow, "dy");
    let x = act_in(p, x, d.c, d.h * d.w);
    let dy = act_in(p, dy, d.k, d.oh * d.ow);
    // One task per output channel k: its r * s * c taps.
    let per_k = par_map(d.k, |k| {
        let mut acc = vec![0.0; d.r * d.s * d.c];
        for r in 0..d.r {
            for s in 0..d.s {
                let a = &mut acc[(r * d.s + s) * d.c..][..d.c];
                for b in 0..d.n {
                    for oy in 0..d.oh {
                        let Some(iy) = Dims::tap(oy, r, d.stride.0, d.dil.0, d.pad.0, d.h) else {
                            continue;
                        };
                        for ox in 0..d.ow {
                            let Some(ix) = Dims::tap(ox, s, d.stride.1, d.dil.1, d.pad.1, d.w)
                            else {
                                continue;
                            };
                            let g = dy[((b * d.oh + oy) * d.ow + ox) * d.k + k];
                            let xs = &x[((b * d.h + iy) * d.w + ix) * d.c..][..d.c];
                            for (av, xv) in a.iter_mut().zip(xs) {
                                *av += g * xv;
                            }
                        }
                    }
                }
            }
        }
        acc
    });
    filter_out(p, per_k.concat())
}

/// The classifier forward: `logits[b][o] = Σ_i features[b][i] · weight[o][i]`.
pub fn fc_forward(n: usize, fin: usize, fout: usize, feat: &[f64], w: &[f64]) -> Vec<f64> {
    par_map(n, |b| {
        (0..fout)
            .map(|o| dot(&feat[b * fin..][..fin], &w[o * fin..][..fin]))
            .collect::<Vec<f64>>()
    })
    .concat()
}

/// The classifier's weight gradient: `dweight[o][i] = Σ_b dlogits[b][o] · features[b][i]`.
pub fn fc_weight_grad(n: usize, fin: usize, fout: usize, feat: &[f64], dlog: &[f64]) -> Vec<f64> {
    par_map(fout, |o| {
        let mut row = vec![0.0; fin];
        for b in 0..n {
            let g = dlog[b * fout + o];
            for (r, f) in row.iter_mut().zip(&feat[b * fin..][..fin]) {
                *r += g * f;
            }
        }
        row
    })
    .concat()
}

/// The classifier's feature gradient: `dfeatures[b][i] = Σ_o dlogits[b][o] · weight[o][i]`.
pub fn fc_feature_grad(n: usize, fin: usize, fout: usize, w: &[f64], dlog: &[f64]) -> Vec<f64> {
    par_map(n, |b| {
        let mut row = vec![0.0; fin];
        for o in 0..fout {
            let g = dlog[b * fout + o];
            for (r, wv) in row.iter_mut().zip(&w[o * fin..][..fin]) {
                *r += g * wv;
            }
        }
        row
    })
    .concat()
}

/// ⟨a, b⟩.
pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The ReLU mask of an activation's output: bit `i` set where `y[i] > 0` (layout of
/// `nnfuse::reference::activation`). A ReLU's output is positive exactly where its input was,
/// so this is the mask the forward used — and what cuDNN's fused backward reads, from y.
pub fn mask_of_output(y: &[f64]) -> Vec<u32> {
    let mut m = vec![0u32; y.len().div_ceil(32)];
    for (i, &v) in y.iter().enumerate() {
        if v > 0.0 {
            m[i / 32] |= 1 << (i % 32);
        }
    }
    m
}

/// How a result compares with its reference.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Compared {
    /// `‖got − want‖₂ / ‖want‖₂` (NaN when `got` has a NaN or infinity).
    pub rel_l2: f64,
    /// The first non-finite element of `got`.
    pub first_nonfinite: Option<usize>,
    /// The element with the largest absolute difference: (index, got, want).
    pub worst: (usize, f64, f64),
    /// Elements compared.
    pub len: usize,
}

impl Compared {
    /// Whether it is finite and within `tol`.
    pub fn within(&self, tol: f64) -> bool {
        self.first_nonfinite.is_none() && self.rel_l2 <= tol
    }
}

/// Compares `got` with `want` (same length).
pub fn compare(got: &[f64], want: &[f64]) -> Compared {
    assert_eq!(got.len(), want.len(), "compared lengths differ");
    let (mut num, mut den) = (0.0, 0.0);
    let mut worst = (
        0,
        got.first().copied().unwrap_or(0.0),
        want.first().copied().unwrap_or(0.0),
    );
    let mut worst_diff = -1.0;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        num += (g - w) * (g - w);
        den += w * w;
        let diff = (g - w).abs();
        if diff > worst_diff || (diff.is_nan() && worst_diff.is_finite()) {
            worst_diff = if diff.is_nan() { f64::INFINITY } else { diff };
            worst = (i, *g, *w);
        }
    }
    let first_nonfinite = got.iter().position(|v| !v.is_finite());
    let rel_l2 = if first_nonfinite.is_some() {
        f64::NAN
    } else {
        (num / den.max(1e-300)).sqrt()
    };
    Compared {
        rel_l2,
        first_nonfinite,
        worst,
        len: got.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nnfuse::reference::conv::conv2d;

    /// In `[-1, 1)`: `-1 + 2u` is `u * 2 - 1` to the bit.
    fn values(seed: u64, n: usize) -> Vec<f64> {
        super::super::test_values(seed, n, -1.0, 1.0)
    }

    fn problems() -> Vec<ConvShape> {
        let mut out = Vec::new();
        for format in [TensorFormat::Nchw, TensorFormat::Nhwc] {
            for (kh, kw, stride, pad, dilation) in [
                (1, 1, (1, 1), (0, 0), (1, 1)),
                (3, 3, (1, 1), (1, 1), (1, 1)),
                (3, 2, (2, 1), (0, 1), (1, 2)),
                (3, 3, (2, 2), (2, 1), (2, 1)),
            ] {
                out.push(ConvShape {
                    n: 2,
                    c_in: 3,
                    h: 7,
                    w: 6,
                    c_out: 4,
                    kh,
                    kw,
                    stride,
                    pad,
                    dilation,
                    format,
                });
            }
        }
        out
    }

    #[test]
    fn forward_matches_the_librarys_reference() {
        for (i, p) in problems().iter().enumerate() {
            let x = values(i as u64 * 3 + 1, p.x_len().unwrap());
            let w = values(i as u64 * 3 + 2, p.w_len().unwrap());
            let want = conv2d(p, &x, &w).unwrap();
            let got = conv_forward(p, &x, &w);
            let c = compare(&got, &want);
            assert!(c.rel_l2 < 1e-14, "{p:?}: {c:?}");
        }
    }

    /// ⟨conv(x, w), dy⟩ = ⟨x, dgrad(dy, w)⟩ = ⟨w, wgrad(x, dy)⟩, and central differences of
    /// the (linear) forward equal the gradients.
    #[test]
    fn gradients_are_adjoints_and_match_finite_differences() {
        for (i, p) in problems().iter().enumerate() {
            let x = values(i as u64 * 5 + 1, p.x_len().unwrap());
            let w = values(i as u64 * 5 + 2, p.w_len().unwrap());
            let dy = values(i as u64 * 5 + 3, p.y_len().unwrap());
            let y = conv2d(p, &x, &w).unwrap();
            let dx = conv_backward_data(p, &dy, &w);
            let dw = conv_backward_filter(p, &x, &dy);
            let a = dot(&y, &dy);
            assert!(
                (a - dot(&x, &dx)).abs() <= 1e-10 * a.abs().max(1.0),
                "{p:?}"
            );
            assert!(
                (a - dot(&w, &dw)).abs() <= 1e-10 * a.abs().max(1.0),
                "{p:?}"
            );
            for j in [0, x.len() / 2, x.len() - 1] {
                let (mut xp, mut xm) = (x.clone(), x.clone());
                xp[j] += 0.5;
                xm[j] -= 0.5;
                let fd =
                    dot(&conv2d(p, &xp, &w).unwrap(), &dy) - dot(&conv2d(p, &xm, &w).unwrap(), &dy);
                assert!(
                    (fd - dx[j]).abs() <= 1e-9,
                    "{p:?} dx[{j}]: {fd} vs {}",
                    dx[j]
                );
            }
            for j in [0, w.len() / 2, w.len() - 1] {
                let (mut wp, mut wm) = (w.clone(), w.clone());
                wp[j] += 0.5;
                wm[j] -= 0.5;
                let fd =
                    dot(&conv2d(p, &x, &wp).unwrap(), &dy) - dot(&conv2d(p, &x, &wm).unwrap(), &dy);
                assert!(
                    (fd - dw[j]).abs() <= 1e-9,
                    "{p:?} dw[{j}]: {fd} vs {}",
                    dw[j]
                );
            }
        }
    }

    #[test]
    fn classifier_references_are_adjoint() {
        let (n, fin, fout) = (3, 5, 4);
        let feat = values(1, n * fin);
        let w = values(2, fout * fin);
        let dlog = values(3, n * fout);
        let logits = fc_forward(n, fin, fout, &feat, &w);
        let a = dot(&logits, &dlog);
        let dw = fc_weight_grad(n, fin, fout, &feat, &dlog);
        let df = fc_feature_grad(n, fin, fout, &w, &dlog);
        assert!((a - dot(&w, &dw)).abs() < 1e-12);
        assert!((a - dot(&feat, &df)).abs() < 1e-12);
        assert_eq!(
            logits[fout + 2],
            dot(&feat[fin..2 * fin], &w[2 * fin..3 * fin])
        );
    }

    #[test]
    fn comparison_reports_the_worst_element_and_non_finite_values() {
        let c = compare(&[1.0, 2.0, 3.5], &[1.0, 2.0, 3.0]);
        assert_eq!(c.worst, (2, 3.5, 3.0));
        assert!((c.rel_l2 - 0.5 / 14f64.sqrt()).abs() < 1e-15);
        assert!(c.within(0.2) && !c.within(0.1));
        let c = compare(&[1.0, f64::NAN, 3.0], &[1.0, 2.0, 3.0]);
        assert_eq!(c.first_nonfinite, Some(1));
        assert!(c.rel_l2.is_nan() && !c.within(1.0));
        assert_eq!(c.worst.0, 1);
        assert_eq!(mask_of_output(&[0.0, 1.0, -0.0, 2.0]), vec![0b1010]);
        assert_eq!(mask_of_output(&[1.0; 33]), vec![u32::MAX, 1]);
    }

    #[test]
    fn parallel_map_keeps_order() {
        let v = par_map(1000, |i| i * 2);
        assert_eq!(v, (0..1000).map(|i| i * 2).collect::<Vec<_>>());
        assert!(par_map(0, |i| i).is_empty());
    }
}
