//! f64 gradient references of the convolution for the GPU tests, written from the definition
//! (independently of the library's code): the data gradient scatters each output gradient back
//! through the taps, the filter gradient sums input times output gradient over the batch and the
//! output pixels. Checked on the CPU by the adjoint identity
//! ⟨conv(x, w), dy⟩ = ⟨x, backward_data(dy, w)⟩ = ⟨w, backward_filter(x, dy)⟩.
#![allow(dead_code)]

use nnfuse::conv::ConvShape;
use nnfuse::TensorFormat;

fn x_at(p: &ConvShape, b: usize, c: usize, iy: usize, ix: usize) -> usize {
    match p.format {
        TensorFormat::Nchw => ((b * p.c_in + c) * p.h + iy) * p.w + ix,
        TensorFormat::Nhwc => ((b * p.h + iy) * p.w + ix) * p.c_in + c,
    }
}

fn w_at(p: &ConvShape, k: usize, c: usize, r: usize, s: usize) -> usize {
    match p.format {
        TensorFormat::Nchw => ((k * p.c_in + c) * p.kh + r) * p.kw + s,
        TensorFormat::Nhwc => ((k * p.kh + r) * p.kw + s) * p.c_in + c,
    }
}

fn y_at(p: &ConvShape, oh: usize, ow: usize, b: usize, k: usize, oy: usize, ox: usize) -> usize {
    match p.format {
        TensorFormat::Nchw => ((b * p.c_out + k) * oh + oy) * ow + ox,
        TensorFormat::Nhwc => ((b * oh + oy) * ow + ox) * p.c_out + k,
    }
}

/// Input coordinates under tap (r, s) of output pixel (oy, ox), or None in the padding.
fn tap(p: &ConvShape, oy: usize, ox: usize, r: usize, s: usize) -> Option<(usize, usize)> {
    let iy = (oy * p.stride.0 + r * p.dilation.0) as i64 - p.pad.0 as i64;
    let ix = (ox * p.stride.1 + s * p.dilation.1) as i64 - p.pad.1 as i64;
    (iy >= 0 && ix >= 0 && (iy as usize) < p.h && (ix as usize) < p.w)
        .then_some((iy as usize, ix as usize))
}

/// dx from dy and w.
pub fn backward_data(p: &ConvShape, dy: &[f64], w: &[f64]) -> Vec<f64> {
    let (oh, ow) = p.out_hw().expect("valid problem");
    assert_eq!(dy.len(), p.y_len().expect("valid"), "dy");
    assert_eq!(w.len(), p.w_len().unwrap(), "w");
    let mut dx = vec![0.0; p.x_len().unwrap()];
    for b in 0..p.n {
        for k in 0..p.c_out {
            for oy in 0..oh {
                for ox in 0..ow {
                    let g = dy[y_at(p, oh, ow, b, k, oy, ox)];
                    for c in 0..p.c_in {
                        for r in 0..p.kh {
                            for s in 0..p.kw {
                                if let Some((iy, ix)) = tap(p, oy, ox, r, s) {
                                    dx[x_at(p, b, c, iy, ix)] += g * w[w_at(p, k, c, r, s)];
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    dx
}

/// dw from x and dy.
pub fn backward_filter(p: &ConvShape, x: &[f64], dy: &[f64]) -> Vec<f64> {
    let (oh, ow) = p.out_hw().expect("valid problem");
    assert_eq!(dy.len(), p.y_len().expect("valid"), "dy");
    assert_eq!(x.len(), p.x_len().unwrap(), "x");
    let mut dw = vec![0.0; p.w_len().unwrap()];
    for k in 0..p.c_out {
        for c in 0..p.c_in {
            for r in 0..p.kh {
                for s in 0..p.kw {
                    let mut acc = 0.0;
                    for b in 0..p.n {
                        for oy in 0..oh {
                            for ox in 0..ow {
                                if let Some((iy, ix)) = tap(p, oy, ox, r, s) {
                                    acc += x[x_at(p, b, c, iy, ix)]
                                        * dy[y_at(p, oh, ow, b, k, oy, ox)];
                                }
                            }
                        }
                    }
                    dw[w_at(p, k, c, r, s)] = acc;
                }
            }
        }
    }
    dw
}

/// ⟨a, b⟩.
pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `f` over `items` on every core, results in order.
pub fn par_map<I: Sync, O: Send + Default + Clone>(
    items: &[I],
    f: impl Fn(&I) -> O + Sync,
) -> Vec<O> {
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let chunk = items.len().div_ceil(threads).max(1);
    let mut out: Vec<O> = vec![O::default(); items.len()];
    std::thread::scope(|sc| {
        for (o, i) in out.chunks_mut(chunk).zip(items.chunks(chunk)) {
            let f = &f;
            sc.spawn(move || {
                for (oo, ii) in o.iter_mut().zip(i) {
                    *oo = f(ii);
                }
            });
        }
    });
    out
}

/// The relative L2 error of `got` against `want` if within `tol` and finite; otherwise a message
/// with the worst element (index, got, want) and the first non-finite one.
pub fn compare(what: &str, got: &[f64], want: &[f64], tol: f64) -> Result<f64, String> {
    assert_eq!(got.len(), want.len(), "{what}: length mismatch");
    let (mut num, mut den) = (0.0, 0.0);
    for (g, w) in got.iter().zip(want) {
        num += (g - w) * (g - w);
        den += w * w;
    }
    let e = (num / den.max(1e-30)).sqrt();
    let bad = got.iter().position(|v| !v.is_finite());
    if bad.is_none() && e <= tol {
        return Ok(e);
    }
    let (wi, wd) = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .enumerate()
        .fold((0, 0.0f64), |acc, (i, d)| {
            if d > acc.1 || d.is_nan() {
                (i, d)
            } else {
                acc
            }
        });
    Err(format!(
        "{what}: relative L2 error {e:.3e} > {tol:.1e}; first non-finite at {bad:?}; worst \
         element {wi}: got {} want {} (|diff| {wd:.3e}); {} elements",
        got[wi],
        want[wi],
        got.len()
    ))
}

/// `n,c,h,w -> k rxs s(..) p(..) d(..)` for messages.
pub fn describe(s: &ConvShape) -> String {
    format!(
        "{} n{} c{} {}x{} -> k{} {}x{} s{:?} p{:?} d{:?}",
        s.format, s.n, s.c_in, s.h, s.w, s.c_out, s.kh, s.kw, s.stride, s.pad, s.dilation
    )
}
