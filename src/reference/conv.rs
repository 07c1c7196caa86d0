//! Direct 2-D convolution and its im2col + GEMM formulation, in f64.
//!
//! **Operation**: cross-correlation, as cuDNN's `CUDNN_CROSS_CORRELATION` and PyTorch's
//! `conv2d` (the filter is not flipped), no bias, groups = 1:
//! `y[b, k, oy, ox] = Σ_{c, r, s} x[b, c, oy*sh + r*dh - ph, ox*sw + s*dw - pw] * w[k, c, r, s]`,
//! where taps outside the input read zero (padding). Tuples are `(height, width)`:
//! `stride = (sh, sw)`, `pad = (ph, pw)` (added on both sides), `dilation = (dh, dw)`.
//! Output size: `oh = (h + 2*ph - dh*(kh-1) - 1) / sh + 1`, likewise `ow`.
//!
//! **Layouts** (row-major):
//!
//! | format | x | w | y |
//! |---|---|---|---|
//! | [`TensorFormat::Nchw`] | `[n][c_in][h][w]` | `[c_out][c_in][kh][kw]` (KCRS) | `[n][c_out][oh][ow]` |
//! | [`TensorFormat::Nhwc`] | `[n][h][w][c_in]` | `[c_out][kh][kw][c_in]` (KRSC, cuDNN's NHWC filter) | `[n][oh][ow][c_out]` |
//!
//! **im2col** ([`im2col`], [`im2col_gemm_problem`]): with `P = oh*ow` output pixels and
//! `K = c_in*kh*kw` filter taps, each image has a `P x K` patch matrix (entry `(p, q)` = the
//! input value under tap `q` of output pixel `p`, 0 in the padding). The tap index `q` runs in
//! the filter's own memory order, so the filter is a `[c_out][K]` row-major matrix as stored:
//! - NCHW: `q = (c*kh + r)*kw + s`; the columns are stored `[n][K][P]` row-major (image `b` at
//!   `b*K*P`): per image the column-major `P x K` matrix with leading dimension `P`
//!   (Caffe's layout). Then `y = cols * filterᵀ` is the column-major `P x c_out` matrix with
//!   leading dimension `P`, which is `[c_out][P]` row-major — exactly y's NCHW layout.
//! - NHWC: `q = (r*kw + s)*c_in + c`; the columns are stored `[n][P][K]` row-major: per image
//!   the column-major `K x P` matrix with leading dimension `K` (each pixel's patch contiguous).
//!   Then `y = filter * cols` is the column-major `c_out x P` matrix with leading dimension
//!   `c_out`, which is `[P][c_out]` row-major — exactly y's NHWC layout.
//!
//! **Gradients** of `L = ⟨y, dy⟩` (the training backward): [`conv2d_backward_data`] gives
//! `dx = ∂L/∂x` in x's layout and [`conv2d_backward_filter`] gives `dw = ∂L/∂w` in the filter's
//! layout, for every stride, padding and dilation; [`col2im`] is the adjoint of [`im2col`] (each
//! input element sums the column entries that read it), so that im2col + GEMM's data gradient
//! is a GEMM into column matrices followed by [`col2im`].

use super::gemm::{gemm_strided_batched, GemmProblem};
pub use crate::conv::problem::ConvShape as Conv2d;
use crate::error::{Error, Result};
use crate::layout::TensorFormat;

/// `Some(product)` or `None` on overflow.
fn product(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |p, &d| p.checked_mul(d))
}

impl Conv2d {
    /// Offset of `x[b, c, iy, ix]` in this problem's format.
    fn x_at(&self, b: usize, c: usize, iy: usize, ix: usize) -> usize {
        match self.format {
            TensorFormat::Nchw => ((b * self.c_in + c) * self.h + iy) * self.w + ix,
            TensorFormat::Nhwc => ((b * self.h + iy) * self.w + ix) * self.c_in + c,
        }
    }

    /// Offset of `w[k, c, r, s]` in this problem's format (KCRS or KRSC).
    fn w_at(&self, k: usize, c: usize, r: usize, s: usize) -> usize {
        match self.format {
            TensorFormat::Nchw => ((k * self.c_in + c) * self.kh + r) * self.kw + s,
            TensorFormat::Nhwc => ((k * self.kh + r) * self.kw + s) * self.c_in + c,
        }
    }

    /// Offset of `y[b, k, oy, ox]` for an output of `(oh, ow)`.
    fn y_at(&self, (oh, ow): (usize, usize), b: usize, k: usize, oy: usize, ox: usize) -> usize {
        match self.format {
            TensorFormat::Nchw => ((b * self.c_out + k) * oh + oy) * ow + ox,
            TensorFormat::Nhwc => ((b * oh + oy) * ow + ox) * self.c_out + k,
        }
    }

    /// Input coordinates under tap `(r, s)` of output pixel `(oy, ox)`, `None` in the padding.
    fn tap(&self, oy: usize, ox: usize, r: usize, s: usize) -> Option<(usize, usize)> {
        let iy = (oy * self.stride.0 + r * self.dilation.0).checked_sub(self.pad.0)?;
        let ix = (ox * self.stride.1 + s * self.dilation.1).checked_sub(self.pad.1)?;
        (iy < self.h && ix < self.w).then_some((iy, ix))
    }

    /// Validates the problem and the lengths of x and w; returns `(oh, ow)`.
    fn check(&self, x: &[f64], w: Option<&[f64]>) -> Result<(usize, usize)> {
        let hw = self.out_hw()?;
        self.y_len()?;
        let x_len = self.x_len()?;
        if x.len() != x_len {
            return Err(Error::invalid(
                "x",
                format!("length {}, expected n*c_in*h*w = {x_len}", x.len()),
            ));
        }
        if let Some(w) = w {
            self.check_w(w)?;
        }
        Ok(hw)
    }

    /// Checks the filter's length against the problem's.
    fn check_w(&self, w: &[f64]) -> Result<()> {
        let w_len = self.w_len()?;
        if w.len() != w_len {
            return Err(Error::invalid(
                "w",
                format!("length {}, expected c_out*c_in*kh*kw = {w_len}", w.len()),
            ));
        }
        Ok(())
    }
}

/// Direct convolution: y in `p.format`'s layout (see the module docs).
///
/// Every output sums its taps in the order `c`, `r`, `s` in both formats, so an NCHW problem
/// and its NHWC permutation give bitwise-identical (permuted) results.
///
/// Errors: as [`Conv2d::out_hw`], and `x` / `w` (named) when a length differs from the
/// problem's.
pub fn conv2d(p: &Conv2d, x: &[f64], w: &[f64]) -> Result<Vec<f64>> {
    let (oh, ow) = p.check(x, Some(w))?;
    let mut y = vec![0.0; p.y_len()?];
    for b in 0..p.n {
        for k in 0..p.c_out {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = 0.0;
                    for c in 0..p.c_in {
                        for r in 0..p.kh {
                            for s in 0..p.kw {
                                if let Some((iy, ix)) = p.tap(oy, ox, r, s) {
                                    acc += x[p.x_at(b, c, iy, ix)] * w[p.w_at(k, c, r, s)];
                                }
                            }
                        }
                    }
                    y[p.y_at((oh, ow), b, k, oy, ox)] = acc;
                }
            }
        }
    }
    Ok(y)
}

/// The patch ("column") matrices of every image, `n * P * K` elements, in the layout of the
/// module docs: NCHW `[n][K][P]`, NHWC `[n][P][K]` row-major, with padding taps 0.
///
/// Errors: as [`Conv2d::out_hw`], and `x` when its length differs from the problem's.
pub fn im2col(p: &Conv2d, x: &[f64]) -> Result<Vec<f64>> {
    let (oh, ow) = p.check(x, None)?;
    let big = || Error::invalid("n", "the column matrix's element count overflows usize");
    let taps = product(&[p.c_in, p.kh, p.kw]).ok_or_else(big)?;
    let pixels = product(&[oh, ow]).ok_or_else(big)?;
    let mut cols = vec![0.0; product(&[p.n, pixels, taps]).ok_or_else(big)?];
    for b in 0..p.n {
        let base = b * pixels * taps;
        for c in 0..p.c_in {
            for r in 0..p.kh {
                for s in 0..p.kw {
                    for oy in 0..oh {
                        for ox in 0..ow {
                            let pix = oy * ow + ox;
                            let at = match p.format {
                                TensorFormat::Nchw => {
                                    base + ((c * p.kh + r) * p.kw + s) * pixels + pix
                                }
                                TensorFormat::Nhwc => {
                                    base + pix * taps + (r * p.kw + s) * p.c_in + c
                                }
                            };
                            if let Some((iy, ix)) = p.tap(oy, ox, r, s) {
                                cols[at] = x[p.x_at(b, c, iy, ix)];
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(cols)
}

/// The strided batched GEMM (one matrix per image) that turns [`im2col`]'s columns and the
/// filter into y, in the module docs' layout; alpha 1, beta 0, packed leading dimensions.
///
/// With `P = oh*ow`, `K = c_in*kh*kw`:
/// - NCHW: **A = columns**, **B = filter**: `m = P`, `n = c_out`, `k = K`, no transposes,
///   `lda = P`, `ldb = K`, `ldc = P`; strides `P*K`, **0** (one filter for every image),
///   `P*c_out`.
/// - NHWC: **A = filter**, **B = columns**: `m = c_out`, `n = P`, `k = K`, `trans_a` (the
///   filter is stored `K x c_out` column-major), `lda = K`, `ldb = K`, `ldc = c_out`; strides
///   **0**, `P*K`, `P*c_out`.
///
/// `batch = n`; C is y.
///
/// Errors: as [`Conv2d::out_hw`].
pub fn im2col_gemm_problem(p: &Conv2d) -> Result<GemmProblem> {
    let (oh, ow) = p.out_hw()?;
    let big = || Error::invalid("n", "the GEMM's sizes overflow usize");
    let pixels = product(&[oh, ow]).ok_or_else(big)?;
    let taps = product(&[p.c_in, p.kh, p.kw]).ok_or_else(big)?;
    let cols_stride = product(&[pixels, taps]).ok_or_else(big)?;
    let y_stride = product(&[pixels, p.c_out]).ok_or_else(big)?;
    let mut g = match p.format {
        TensorFormat::Nchw => GemmProblem {
            lda: pixels,
            ldb: taps,
            ldc: pixels,
            stride_a: cols_stride,
            stride_b: 0,
            ..GemmProblem::packed(p.n, pixels, p.c_out, taps)
        },
        TensorFormat::Nhwc => GemmProblem {
            trans_a: true,
            lda: taps,
            ldb: taps,
            ldc: p.c_out,
            stride_a: 0,
            stride_b: cols_stride,
            ..GemmProblem::packed(p.n, p.c_out, pixels, taps)
        },
    };
    g.stride_c = y_stride;
    Ok(g)
}

/// Convolution as [`im2col`] followed by [`gemm_strided_batched`] with
/// [`im2col_gemm_problem`]; equal to [`conv2d`] up to rounding (the NHWC GEMM sums the taps in
/// `r`, `s`, `c` order).
///
/// Errors: as [`conv2d`].
pub fn conv2d_via_gemm(p: &Conv2d, x: &[f64], w: &[f64]) -> Result<Vec<f64>> {
    p.check(x, Some(w))?;
    let cols = im2col(p, x)?;
    let g = im2col_gemm_problem(p)?;
    let mut y = vec![0.0; p.y_len()?];
    match p.format {
        TensorFormat::Nchw => gemm_strided_batched(&g, &cols, w, &mut y),
        TensorFormat::Nhwc => gemm_strided_batched(&g, w, &cols, &mut y),
    }?;
    Ok(y)
}

/// Output index along one axis whose tap `k` reads input index `i`, if any:
/// `o * stride + k * dilation - pad == i` with `0 <= o < out`.
fn out_index(
    i: usize,
    k: usize,
    stride: usize,
    pad: usize,
    dilation: usize,
    out: usize,
) -> Option<usize> {
    let t = (i + pad).checked_sub(k * dilation)?;
    (t % stride == 0 && t / stride < out).then_some(t / stride)
}

impl Conv2d {
    /// Validates the problem, `dy`'s length (named `dy_name`) and, when given, the filter's;
    /// returns `(oh, ow)` and x's element count (checked for overflow).
    fn check_grad(
        &self,
        dy: &[f64],
        dy_name: &str,
        w: Option<&[f64]>,
    ) -> Result<((usize, usize), usize)> {
        let hw = self.out_hw()?;
        let y_len = self.y_len()?;
        let x_len = self.x_len()?;
        if dy.len() != y_len {
            return Err(Error::invalid(
                dy_name,
                format!("length {}, expected n*c_out*oh*ow = {y_len}", dy.len()),
            ));
        }
        if let Some(w) = w {
            self.check_w(w)?;
        }
        Ok((hw, x_len))
    }
}

/// The data gradient of [`conv2d`]: `dx = ∂⟨conv2d(x, w), dy⟩ / ∂x`, in `p.format`'s layout
/// (x's shape), for any stride, padding and dilation:
/// `dx[b, c, iy, ix] = Σ_{k, r, s} dy[b, k, oy, ox] * w[k, c, r, s]` over the taps with
/// `oy*sh + r*dh - ph = iy` and `ox*sw + s*dw - pw = ix` (inside the output).
///
/// Computed by gather (each input element sums its own taps, in the order `k`, `r`, `s` in both
/// formats), independently of [`conv2d`]'s loops, so that the adjoint identity
/// `⟨conv2d(x, w), dy⟩ = ⟨x, conv2d_backward_data(dy, w)⟩` checks one against the other.
///
/// Errors: as [`Conv2d::out_hw`]; `dy` or `w` (named) when a length differs from the
/// problem's; `n` when x's element count overflows.
pub fn conv2d_backward_data(p: &Conv2d, dy: &[f64], w: &[f64]) -> Result<Vec<f64>> {
    let ((oh, ow), x_len) = p.check_grad(dy, "dy", Some(w))?;
    let mut dx = vec![0.0; x_len];
    for b in 0..p.n {
        for c in 0..p.c_in {
            for iy in 0..p.h {
                for ix in 0..p.w {
                    let mut acc = 0.0;
                    for k in 0..p.c_out {
                        for r in 0..p.kh {
                            let Some(oy) = out_index(iy, r, p.stride.0, p.pad.0, p.dilation.0, oh)
                            else {
                                continue;
                            };
                            for s in 0..p.kw {
                                if let Some(ox) =
                                    out_index(ix, s, p.stride.1, p.pad.1, p.dilation.1, ow)
                                {
                                    acc +=
                                        dy[p.y_at((oh, ow), b, k, oy, ox)] * w[p.w_at(k, c, r, s)];
                                }
                            }
                        }
                    }
                    dx[p.x_at(b, c, iy, ix)] = acc;
                }
            }
        }
    }
    Ok(dx)
}

/// The filter gradient of [`conv2d`]: `dw = ∂⟨conv2d(x, w), dy⟩ / ∂w`, in `p.format`'s filter
/// layout (KCRS or KRSC): `dw[k, c, r, s] = Σ_{b, oy, ox} dy[b, k, oy, ox] * x[b, c, iy, ix]`
/// over the taps that fall inside the input. Sums in the order `b`, `oy`, `ox` in both formats.
///
/// Errors: as [`Conv2d::out_hw`]; `x` or `dy` (named) when a length differs from the problem's.
pub fn conv2d_backward_filter(p: &Conv2d, x: &[f64], dy: &[f64]) -> Result<Vec<f64>> {
    let ((oh, ow), x_len) = p.check_grad(dy, "dy", None)?;
    if x.len() != x_len {
        return Err(Error::invalid(
            "x",
            format!("length {}, expected n*c_in*h*w = {x_len}", x.len()),
        ));
    }
    let mut dw = vec![0.0; p.w_len()?];
    for k in 0..p.c_out {
        for c in 0..p.c_in {
            for r in 0..p.kh {
                for s in 0..p.kw {
                    let mut acc = 0.0;
                    for b in 0..p.n {
                        for oy in 0..oh {
                            for ox in 0..ow {
                                if let Some((iy, ix)) = p.tap(oy, ox, r, s) {
                                    acc += dy[p.y_at((oh, ow), b, k, oy, ox)]
                                        * x[p.x_at(b, c, iy, ix)];
                                }
                            }
                        }
                    }
                    dw[p.w_at(k, c, r, s)] = acc;
                }
            }
        }
    }
    Ok(dw)
}

/// The adjoint of [`im2col`]: every input element (x's layout) is the sum of the column
/// entries that read it (padding taps read nothing). `cols` is laid out as [`im2col`]'s result
/// (`[n][K][P]` for NCHW, `[n][P][K]` for NHWC); `⟨im2col(x), cols⟩ = ⟨x, col2im(cols)⟩`.
///
/// Errors: as [`Conv2d::out_hw`], and `cols` when its length is not `n * P * K`.
pub fn col2im(p: &Conv2d, cols: &[f64]) -> Result<Vec<f64>> {
    let (oh, ow) = p.out_hw()?;
    let big = || Error::invalid("n", "the column matrix's element count overflows usize");
    let taps = product(&[p.c_in, p.kh, p.kw]).ok_or_else(big)?;
    // Unlike im2col, y's length is not checked here: the pixel count may overflow on its own.
    let pixels = product(&[oh, ow]).ok_or_else(big)?;
    let want = product(&[p.n, pixels, taps]).ok_or_else(big)?;
    if cols.len() != want {
        return Err(Error::invalid(
            "cols",
            format!(
                "length {}, expected n*oh*ow*c_in*kh*kw = {want}",
                cols.len()
            ),
        ));
    }
    let mut x = vec![0.0; p.x_len()?];
    for b in 0..p.n {
        let base = b * pixels * taps;
        for c in 0..p.c_in {
            for r in 0..p.kh {
                for s in 0..p.kw {
                    for oy in 0..oh {
                        for ox in 0..ow {
                            let Some((iy, ix)) = p.tap(oy, ox, r, s) else {
                                continue;
                            };
                            let pix = oy * ow + ox;
                            let at = match p.format {
                                TensorFormat::Nchw => {
                                    base + ((c * p.kh + r) * p.kw + s) * pixels + pix
                                }
                                TensorFormat::Nhwc => {
                                    base + pix * taps + (r * p.kw + s) * p.c_in + c
                                }
                            };
                            x[p.x_at(b, c, iy, ix)] += cols[at];
                        }
                    }
                }
            }
        }
    }
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use TensorFormat::{Nchw, Nhwc};

    /// `n = 1`, `c_in = c_out = 1`, stride 1, pad 0, dilation 1.
    fn single(h: usize, w: usize, kh: usize, kw: usize, format: TensorFormat) -> Conv2d {
        Conv2d {
            n: 1,
            c_in: 1,
            h,
            w,
            c_out: 1,
            kh,
            kw,
            stride: (1, 1),
            pad: (0, 0),
            dilation: (1, 1),
            format,
        }
    }

    const X3: [f64; 9] = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0];

    fn both(p: &Conv2d, x: &[f64], w: &[f64]) -> Vec<f64> {
        let y = conv2d(p, x, w).unwrap();
        assert_eq!(conv2d_via_gemm(p, x, w).unwrap(), y, "via GEMM differs");
        y
    }

    #[test]
    fn three_by_three_two_by_two_hand_computed() {
        // x = [1 2 3; 4 5 6; 7 8 9], w = [1 2; 3 4], no flip (cross-correlation):
        //   y00 = 1*1 + 2*2 + 4*3 + 5*4 = 37    y01 = 2*1 + 3*2 + 5*3 + 6*4 = 47
        //   y10 = 4*1 + 5*2 + 7*3 + 8*4 = 67    y11 = 5*1 + 6*2 + 8*3 + 9*4 = 77
        // (a flipped convolution would give y00 = 1*4 + 2*3 + 4*2 + 5*1 = 23).
        for f in [Nchw, Nhwc] {
            let p = single(3, 3, 2, 2, f);
            assert_eq!(p.out_hw().unwrap(), (2, 2));
            assert_eq!(
                both(&p, &X3, &[1.0, 2.0, 3.0, 4.0]),
                vec![37.0, 47.0, 67.0, 77.0]
            );
        }
    }

    #[test]
    fn padding_stride_dilation_hand_computed() {
        let ones = [1.0; 9];
        for f in [Nchw, Nhwc] {
            // 3x3 ones filter, pad 1: each output is the sum of the 3x3 neighbourhood in x.
            //   y00 = 1+2+4+5 = 12, y01 = 1+2+3+4+5+6 = 21, y02 = 2+3+5+6 = 16,
            //   y10 = 1+2+4+5+7+8 = 27, y11 = 45, y12 = 2+3+5+6+8+9 = 33,
            //   y20 = 4+5+7+8 = 24, y21 = 4+5+6+7+8+9 = 39, y22 = 5+6+8+9 = 28.
            let p = Conv2d {
                pad: (1, 1),
                ..single(3, 3, 3, 3, f)
            };
            assert_eq!(p.out_hw().unwrap(), (3, 3));
            assert_eq!(
                both(&p, &X3, &ones),
                vec![12.0, 21.0, 16.0, 27.0, 45.0, 33.0, 24.0, 39.0, 28.0]
            );
            // Stride 2: oh = (3 + 2 - 3)/2 + 1 = 2, the corners y00, y02, y20, y22.
            let p = Conv2d {
                stride: (2, 2),
                ..p
            };
            assert_eq!(p.out_hw().unwrap(), (2, 2));
            assert_eq!(both(&p, &X3, &ones), vec![12.0, 16.0, 24.0, 28.0]);
            // Stride (2, 1): rows 0 and 2 of the stride-1 output.
            let p = Conv2d {
                stride: (2, 1),
                ..p
            };
            assert_eq!(
                both(&p, &X3, &ones),
                vec![12.0, 21.0, 16.0, 24.0, 39.0, 28.0]
            );
            // Dilation 2, 2x2 filter [1 2; 3 4]: extent 3, oh = (3 - 2 - 1) + 1 = 1; taps
            // x00, x02, x20, x22: 1*1 + 3*2 + 7*3 + 9*4 = 64.
            let p = Conv2d {
                dilation: (2, 2),
                ..single(3, 3, 2, 2, f)
            };
            assert_eq!(p.out_hw().unwrap(), (1, 1));
            assert_eq!(both(&p, &X3, &[1.0, 2.0, 3.0, 4.0]), vec![64.0]);
            // Pad 2 with a 1x1 filter of 2: a 7x7 output whose border is padding (0).
            let p = Conv2d {
                pad: (2, 2),
                ..single(3, 3, 1, 1, f)
            };
            assert_eq!(p.out_hw().unwrap(), (7, 7));
            let y = both(&p, &X3, &[2.0]);
            for oy in 0..7 {
                for ox in 0..7 {
                    let inside = (2..5).contains(&oy) && (2..5).contains(&ox);
                    let want = if inside {
                        2.0 * X3[(oy - 2) * 3 + ox - 2]
                    } else {
                        0.0
                    };
                    assert_eq!(y[oy * 7 + ox], want);
                }
            }
        }
    }

    #[test]
    fn asymmetric_hand_computed() {
        for f in [Nchw, Nhwc] {
            // Pad (1, 0) with a 1x1 filter [1]: oh = 3 + 2 = 5, ow = 3; rows 0 and 4 are
            // padding, rows 1..=3 are x.
            let p = Conv2d {
                pad: (1, 0),
                ..single(3, 3, 1, 1, f)
            };
            assert_eq!(p.out_hw().unwrap(), (5, 3));
            let mut want = vec![0.0; 3];
            want.extend_from_slice(&X3);
            want.extend_from_slice(&[0.0; 3]);
            assert_eq!(both(&p, &X3, &[1.0]), want);
            // Dilation (1, 2), filter [1 2; 3 4]: extents (2, 3), output 2x1;
            //   y0 = x00*1 + x02*2 + x10*3 + x12*4 = 1 + 6 + 12 + 24 = 43
            //   y1 = x10*1 + x12*2 + x20*3 + x22*4 = 4 + 12 + 21 + 36 = 73
            let p = Conv2d {
                dilation: (1, 2),
                ..single(3, 3, 2, 2, f)
            };
            assert_eq!(p.out_hw().unwrap(), (2, 1));
            assert_eq!(both(&p, &X3, &[1.0, 2.0, 3.0, 4.0]), vec![43.0, 73.0]);
            // Stride (1, 2), 2x2 filter [1 2; 3 4], on a 2x3 input [1 2 3; 4 5 6]: output
            // 1x1 (ow = (3 - 2)/2 + 1 = 1): 1 + 4 + 12 + 20 = 37.
            let p = Conv2d {
                stride: (1, 2),
                ..single(2, 3, 2, 2, f)
            };
            assert_eq!(p.out_hw().unwrap(), (1, 1));
            assert_eq!(both(&p, &X3[..6], &[1.0, 2.0, 3.0, 4.0]), vec![37.0]);
        }
    }

    #[test]
    fn two_filters_layouts_hand_computed() {
        // Filter 0 = [1 2; 3 4] (y = 37, 47, 67, 77 as above); filter 1 = [-1 0; 0 1]:
        // y = x[oy+1][ox+1] - x[oy][ox] = 4 everywhere. With one input channel KCRS = KRSC.
        let w = [1.0, 2.0, 3.0, 4.0, -1.0, 0.0, 0.0, 1.0];
        let p = Conv2d {
            c_out: 2,
            ..single(3, 3, 2, 2, Nchw)
        };
        assert_eq!(
            both(&p, &X3, &w),
            vec![37.0, 47.0, 67.0, 77.0, 4.0, 4.0, 4.0, 4.0]
        );
        let p = Conv2d { format: Nhwc, ..p };
        assert_eq!(
            both(&p, &X3, &w),
            vec![37.0, 4.0, 47.0, 4.0, 67.0, 4.0, 77.0, 4.0]
        );
    }

    #[test]
    fn im2col_layout_hand_computed() {
        // Two channels: x0 = [1 .. 9], x1 = 10 * x0; 2x2 filter, stride 1, pad 0: P = 4, K = 8.
        let x1: Vec<f64> = X3.iter().map(|v| 10.0 * v).collect();
        // NCHW: [K][P], K = (c, r, s). Patch of pixel (oy, ox) under tap (r, s) is
        // x[oy + r][ox + s]; pixels run (0,0), (0,1), (1,0), (1,1).
        let x_nchw: Vec<f64> = X3.iter().chain(&x1).copied().collect();
        let p = Conv2d {
            c_in: 2,
            ..single(3, 3, 2, 2, Nchw)
        };
        #[rustfmt::skip]
        let want = vec![
            1.0, 2.0, 4.0, 5.0,       // c0 r0 s0
            2.0, 3.0, 5.0, 6.0,       // c0 r0 s1
            4.0, 5.0, 7.0, 8.0,       // c0 r1 s0
            5.0, 6.0, 8.0, 9.0,       // c0 r1 s1
            10.0, 20.0, 40.0, 50.0,   // c1 r0 s0
            20.0, 30.0, 50.0, 60.0,   // c1 r0 s1
            40.0, 50.0, 70.0, 80.0,   // c1 r1 s0
            50.0, 60.0, 80.0, 90.0,   // c1 r1 s1
        ];
        assert_eq!(im2col(&p, &x_nchw).unwrap(), want);
        // NHWC: [P][K], K = (r, s, c); x interleaves the channels.
        let x_nhwc: Vec<f64> = X3.iter().flat_map(|v| [*v, 10.0 * v]).collect();
        let p = Conv2d { format: Nhwc, ..p };
        #[rustfmt::skip]
        let want = vec![
            1.0, 10.0, 2.0, 20.0, 4.0, 40.0, 5.0, 50.0,   // pixel (0,0)
            2.0, 20.0, 3.0, 30.0, 5.0, 50.0, 6.0, 60.0,   // pixel (0,1)
            4.0, 40.0, 5.0, 50.0, 7.0, 70.0, 8.0, 80.0,   // pixel (1,0)
            5.0, 50.0, 6.0, 60.0, 8.0, 80.0, 9.0, 90.0,   // pixel (1,1)
        ];
        assert_eq!(im2col(&p, &x_nhwc).unwrap(), want);
        // Padding taps are zero: 1x1 input, 3x3 filter, pad 1 → one pixel, only the centre
        // tap (r = s = 1) reads x.
        let p = Conv2d {
            pad: (1, 1),
            ..single(1, 1, 3, 3, Nchw)
        };
        assert_eq!(
            im2col(&p, &[7.0]).unwrap(),
            vec![0.0, 0.0, 0.0, 0.0, 7.0, 0.0, 0.0, 0.0, 0.0]
        );
    }

    #[test]
    fn gemm_problem_description() {
        let p = Conv2d {
            n: 3,
            c_in: 5,
            h: 8,
            w: 6,
            c_out: 7,
            kh: 3,
            kw: 3,
            stride: (1, 1),
            pad: (1, 1),
            dilation: (1, 1),
            format: Nchw,
        };
        // P = 8*6 = 48, K = 5*9 = 45.
        let g = im2col_gemm_problem(&p).unwrap();
        assert_eq!(
            (g.trans_a, g.trans_b, g.m, g.n, g.k, g.lda, g.ldb, g.ldc),
            (false, false, 48, 7, 45, 48, 45, 48)
        );
        assert_eq!(
            (g.stride_a, g.stride_b, g.stride_c, g.batch),
            (48 * 45, 0, 48 * 7, 3)
        );
        assert_eq!((g.alpha, g.beta), (1.0, 0.0));
        let g = im2col_gemm_problem(&Conv2d { format: Nhwc, ..p }).unwrap();
        assert_eq!(
            (g.trans_a, g.trans_b, g.m, g.n, g.k, g.lda, g.ldb, g.ldc),
            (true, false, 7, 48, 45, 45, 45, 7)
        );
        assert_eq!(
            (g.stride_a, g.stride_b, g.stride_c, g.batch),
            (0, 48 * 45, 48 * 7, 3)
        );
    }

    pub(super) use crate::testutil::xorshift_star_values as values;

    /// NCHW → NHWC for x-like (`[n][c][h][w]` → `[n][h][w][c]`) and, with `n = c_out`, for
    /// filters (KCRS → KRSC).
    pub(super) fn to_nhwc(v: &[f64], n: usize, c: usize, h: usize, w: usize) -> Vec<f64> {
        let mut out = vec![0.0; v.len()];
        for b in 0..n {
            for ch in 0..c {
                for y in 0..h {
                    for x in 0..w {
                        out[((b * h + y) * w + x) * c + ch] = v[((b * c + ch) * h + y) * w + x];
                    }
                }
            }
        }
        out
    }

    /// The module docs' formula, written independently of `Conv2d::tap` and the index helpers
    /// (signed coordinates, bounds test on each tap), for NCHW.
    fn textbook_nchw(p: &Conv2d, x: &[f64], w: &[f64]) -> Vec<f64> {
        let (oh, ow) = p.out_hw().unwrap();
        let mut y = Vec::new();
        for b in 0..p.n {
            for k in 0..p.c_out {
                for oy in 0..oh as i64 {
                    for ox in 0..ow as i64 {
                        let mut acc = 0.0;
                        for c in 0..p.c_in {
                            for r in 0..p.kh as i64 {
                                for s in 0..p.kw as i64 {
                                    let iy = oy * p.stride.0 as i64 + r * p.dilation.0 as i64
                                        - p.pad.0 as i64;
                                    let ix = ox * p.stride.1 as i64 + s * p.dilation.1 as i64
                                        - p.pad.1 as i64;
                                    if iy < 0 || ix < 0 || iy >= p.h as i64 || ix >= p.w as i64 {
                                        continue;
                                    }
                                    let xi = (b * p.c_in + c) * p.h * p.w
                                        + iy as usize * p.w
                                        + ix as usize;
                                    let wi = (k * p.c_in + c) * p.kh * p.kw
                                        + r as usize * p.kw
                                        + s as usize;
                                    acc += x[xi] * w[wi];
                                }
                            }
                        }
                        y.push(acc);
                    }
                }
            }
        }
        y
    }

    /// The references against each other, over strides, paddings, dilations, filter shapes
    /// and channel counts that are not powers of two: direct == im2col + GEMM in both formats,
    /// and NCHW == NHWC after permuting inputs, filters and outputs (bitwise for the direct
    /// convolution, which sums in the same order in both formats).
    #[test]
    fn direct_equals_gemm_and_formats_agree() {
        let mut ran = 0;
        let mut rejected = 0;
        let mut seed = 1;
        for (c_in, c_out) in [(3, 5), (1, 7), (6, 1)] {
            for (kh, kw) in [(1, 1), (3, 3), (5, 3)] {
                for stride in [(1, 1), (2, 2), (1, 2), (2, 1)] {
                    for pad in [(0, 0), (1, 1), (2, 2), (0, 2), (1, 0)] {
                        for dilation in [(1, 1), (2, 2), (1, 2)] {
                            let p = Conv2d {
                                n: 2,
                                c_in,
                                h: 7,
                                w: 6,
                                c_out,
                                kh,
                                kw,
                                stride,
                                pad,
                                dilation,
                                format: Nchw,
                            };
                            let (oh, ow) = match p.out_hw() {
                                Ok(hw) => hw,
                                Err(e) => {
                                    // Only a filter larger than the padded input is refused.
                                    let arg = e.argument();
                                    assert!(arg == Some("kh") || arg == Some("kw"), "{e}");
                                    assert!(
                                        dilation.0 * (kh - 1) + 1 > 7 + 2 * pad.0
                                            || dilation.1 * (kw - 1) + 1 > 6 + 2 * pad.1
                                    );
                                    rejected += 1;
                                    continue;
                                }
                            };
                            seed += 1;
                            let x = values(seed, p.x_len().unwrap());
                            let w = values(seed + 1000, p.w_len().unwrap());
                            let y = conv2d(&p, &x, &w).unwrap();
                            assert_eq!(y, textbook_nchw(&p, &x, &w), "{p:?}");
                            let yg = conv2d_via_gemm(&p, &x, &w).unwrap();
                            for (a, b) in y.iter().zip(&yg) {
                                assert!((a - b).abs() <= 1e-12, "{p:?}: {a} vs {b}");
                            }
                            let q = Conv2d { format: Nhwc, ..p };
                            let xl = to_nhwc(&x, p.n, c_in, p.h, p.w);
                            let wl = to_nhwc(&w, c_out, c_in, kh, kw);
                            let yl = conv2d(&q, &xl, &wl).unwrap();
                            assert_eq!(yl, to_nhwc(&y, p.n, c_out, oh, ow), "{q:?}");
                            let ylg = conv2d_via_gemm(&q, &xl, &wl).unwrap();
                            for (a, b) in yl.iter().zip(&ylg) {
                                assert!((a - b).abs() <= 1e-12, "{q:?}: {a} vs {b}");
                            }
                            ran += 1;
                        }
                    }
                }
            }
        }
        assert!(ran > 400 && rejected > 0, "ran {ran}, rejected {rejected}");
    }

    #[test]
    fn errors_name_the_argument() {
        let p = single(3, 3, 2, 2, Nchw);
        let arg = |q: Conv2d| q.out_hw().unwrap_err().argument().map(str::to_owned);
        assert_eq!(
            arg(Conv2d {
                stride: (0, 1),
                ..p
            })
            .as_deref(),
            Some("stride")
        );
        assert_eq!(
            arg(Conv2d {
                stride: (1, 0),
                ..p
            })
            .as_deref(),
            Some("stride")
        );
        assert_eq!(
            arg(Conv2d {
                dilation: (1, 0),
                ..p
            })
            .as_deref(),
            Some("dilation")
        );
        assert_eq!(arg(Conv2d { kh: 4, ..p }).as_deref(), Some("kh"));
        assert_eq!(
            arg(Conv2d {
                kw: 2,
                dilation: (1, 3),
                ..p
            })
            .as_deref(),
            Some("kw")
        );
        // ... but padding makes room: 3 + 2*1 >= 4.
        assert_eq!(
            Conv2d {
                kh: 4,
                pad: (1, 0),
                ..p
            }
            .out_hw()
            .unwrap(),
            (2, 2)
        );
        for (name, q) in [
            ("n", Conv2d { n: 0, ..p }),
            ("c_in", Conv2d { c_in: 0, ..p }),
            ("h", Conv2d { h: 0, ..p }),
            ("w", Conv2d { w: 0, ..p }),
            ("c_out", Conv2d { c_out: 0, ..p }),
            ("kh", Conv2d { kh: 0, ..p }),
            ("kw", Conv2d { kw: 0, ..p }),
        ] {
            assert_eq!(arg(q).as_deref(), Some(name));
        }
        assert_eq!(
            arg(Conv2d {
                pad: (usize::MAX, 0),
                ..p
            })
            .as_deref(),
            Some("kh")
        );
        let e = conv2d(&p, &X3[..8], &[1.0; 4]).unwrap_err();
        assert_eq!(e.argument(), Some("x"));
        let e = conv2d(&p, &X3, &[1.0; 5]).unwrap_err();
        assert_eq!(e.argument(), Some("w"));
        let e = conv2d_via_gemm(&p, &X3, &[1.0; 3]).unwrap_err();
        assert_eq!(e.argument(), Some("w"));
        assert_eq!(im2col(&p, &[]).unwrap_err().argument(), Some("x"));
        assert_eq!(
            im2col_gemm_problem(&Conv2d { kh: 9, ..p })
                .unwrap_err()
                .argument(),
            Some("kh")
        );
        assert_eq!(p.y_len().unwrap(), 4);
        assert_eq!((p.x_len().unwrap(), p.w_len().unwrap()), (9, 4));
    }
}

#[cfg(test)]
mod gradient_tests {
    use super::tests::{to_nhwc, values};
    use super::*;
    use TensorFormat::{Nchw, Nhwc};

    fn dot(a: &[f64], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    /// Small pseudo-random integers (splitmix64).
    struct Dice(u64);
    impl Dice {
        fn below(&mut self, n: usize) -> usize {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % n as u64) as usize
        }
        fn pick<T: Copy>(&mut self, v: &[T]) -> T {
            v[self.below(v.len())]
        }
    }

    /// A random valid problem: odd sizes, strides, dilations, asymmetric padding.
    fn random_problem(d: &mut Dice, format: TensorFormat) -> Conv2d {
        loop {
            let p = Conv2d {
                n: 1 + d.below(3),
                c_in: d.pick(&[1, 2, 3, 5]),
                h: 1 + d.below(9),
                w: 1 + d.below(9),
                c_out: d.pick(&[1, 2, 3, 4]),
                kh: 1 + d.below(4),
                kw: 1 + d.below(4),
                stride: (1 + d.below(3), 1 + d.below(3)),
                pad: (d.below(3), d.below(3)),
                dilation: (1 + d.below(3), 1 + d.below(2)),
                format,
            };
            if p.out_hw().is_ok() {
                return p;
            }
        }
    }

    fn rel(a: f64, b: f64) -> f64 {
        (a - b).abs() / a.abs().max(b.abs()).max(1e-300)
    }

    #[test]
    fn one_hot_gradients_hand_computed() {
        // x = [1 2 3; 4 5 6; 7 8 9], w = [1 2; 3 4], stride 1, no padding: y is 2x2.
        for f in [Nchw, Nhwc] {
            let p = Conv2d {
                n: 1,
                c_in: 1,
                h: 3,
                w: 3,
                c_out: 1,
                kh: 2,
                kw: 2,
                stride: (1, 1),
                pad: (0, 0),
                dilation: (1, 1),
                format: f,
            };
            let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0];
            let w = [1.0, 2.0, 3.0, 4.0];
            // dy one-hot at output (1, 0): dx is w placed with its corner at input (1, 0);
            // dw is the 2x2 patch of x under output (1, 0): [4 5; 7 8].
            let dy = [0.0, 0.0, 1.0, 0.0];
            assert_eq!(
                conv2d_backward_data(&p, &dy, &w).unwrap(),
                vec![0.0, 0.0, 0.0, 1.0, 2.0, 0.0, 3.0, 4.0, 0.0]
            );
            assert_eq!(
                conv2d_backward_filter(&p, &x, &dy).unwrap(),
                vec![4.0, 5.0, 7.0, 8.0]
            );
            // dy of ones: dx counts how many outputs each input feeds, weighted by w:
            // corners see one tap, edges two, the centre all four.
            assert_eq!(
                conv2d_backward_data(&p, &[1.0; 4], &w).unwrap(),
                vec![1.0, 3.0, 2.0, 4.0, 10.0, 6.0, 3.0, 7.0, 4.0]
            );
            // Stride 2, pad 1, dilation 2 on the same x, 2x2 filter: oh = (3+2-3)/2+1 = 2.
            // Output (0, 0) taps inputs (-1,-1), (-1,1), (1,-1), (1,1): only (1,1) = 5 is
            // inside, under tap (1, 1).
            let q = Conv2d {
                stride: (2, 2),
                pad: (1, 1),
                dilation: (2, 2),
                ..p
            };
            assert_eq!(q.out_hw().unwrap(), (2, 2));
            let dy = [1.0, 0.0, 0.0, 0.0];
            assert_eq!(
                conv2d_backward_filter(&q, &x, &dy).unwrap(),
                vec![0.0, 0.0, 0.0, 5.0]
            );
            let mut want = vec![0.0; 9];
            want[4] = 4.0; // w[1][1] lands on input (1, 1)
            assert_eq!(conv2d_backward_data(&q, &dy, &w).unwrap(), want);
        }
    }

    /// Central differences of `L = ⟨conv2d(x, w), dy⟩` in every element of x and w. L is
    /// linear in each, so the difference quotient equals the gradient up to rounding.
    #[test]
    fn finite_differences_match_the_gradients() {
        let mut d = Dice(7);
        let mut checked = 0;
        for round in 0..24 {
            let format = if round % 2 == 0 { Nchw } else { Nhwc };
            let p = random_problem(&mut d, format);
            let seed = 100 + round as u64;
            let x = values(seed, p.x_len().unwrap());
            let w = values(seed + 1, p.w_len().unwrap());
            let dy = values(seed + 2, p.y_len().unwrap());
            let loss = |x: &[f64], w: &[f64]| dot(&conv2d(&p, x, w).unwrap(), &dy);
            let dx = conv2d_backward_data(&p, &dy, &w).unwrap();
            let dw = conv2d_backward_filter(&p, &x, &dy).unwrap();
            let eps = 1e-3;
            for i in 0..x.len() {
                let (mut xp, mut xm) = (x.clone(), x.clone());
                xp[i] += eps;
                xm[i] -= eps;
                let fd = (loss(&xp, &w) - loss(&xm, &w)) / (2.0 * eps);
                assert!(
                    (fd - dx[i]).abs() <= 1e-8,
                    "{p:?} dx[{i}]: fd {fd} vs {}",
                    dx[i]
                );
                checked += 1;
            }
            for i in 0..w.len() {
                let (mut wp, mut wm) = (w.clone(), w.clone());
                wp[i] += eps;
                wm[i] -= eps;
                let fd = (loss(&x, &wp) - loss(&x, &wm)) / (2.0 * eps);
                assert!(
                    (fd - dw[i]).abs() <= 1e-8,
                    "{p:?} dw[{i}]: fd {fd} vs {}",
                    dw[i]
                );
                checked += 1;
            }
        }
        assert!(checked > 500, "only {checked} derivatives checked");
    }

    /// `⟨conv(x, w), dy⟩ = ⟨x, backward_data(dy, w)⟩ = ⟨w, backward_filter(x, dy)⟩` and
    /// `⟨im2col(x), c⟩ = ⟨x, col2im(c)⟩` on many random problems of both formats; and the
    /// NCHW gradients equal the NHWC ones after permuting (bitwise: same summation orders).
    #[test]
    fn adjoint_identities_hold_on_random_problems() {
        let mut d = Dice(42);
        for round in 0..300u64 {
            let p = random_problem(&mut d, Nchw);
            let (oh, ow) = p.out_hw().unwrap();
            let x = values(3 * round + 1, p.x_len().unwrap());
            let w = values(3 * round + 2, p.w_len().unwrap());
            let dy = values(3 * round + 3, p.y_len().unwrap());
            let y = conv2d(&p, &x, &w).unwrap();
            let dx = conv2d_backward_data(&p, &dy, &w).unwrap();
            let dw = conv2d_backward_filter(&p, &x, &dy).unwrap();
            let l = dot(&y, &dy);
            assert!(
                rel(l, dot(&x, &dx)) <= 1e-12,
                "{p:?}: {l} vs {}",
                dot(&x, &dx)
            );
            assert!(
                rel(l, dot(&w, &dw)) <= 1e-12,
                "{p:?}: {l} vs {}",
                dot(&w, &dw)
            );
            let cols = im2col(&p, &x).unwrap();
            let c = values(round + 9999, cols.len());
            let xc = col2im(&p, &c).unwrap();
            assert!(
                rel(dot(&cols, &c), dot(&x, &xc)) <= 1e-12,
                "{p:?}: im2col adjoint"
            );

            let q = Conv2d { format: Nhwc, ..p };
            let xl = to_nhwc(&x, p.n, p.c_in, p.h, p.w);
            let wl = to_nhwc(&w, p.c_out, p.c_in, p.kh, p.kw);
            let dyl = to_nhwc(&dy, p.n, p.c_out, oh, ow);
            assert_eq!(
                conv2d_backward_data(&q, &dyl, &wl).unwrap(),
                to_nhwc(&dx, p.n, p.c_in, p.h, p.w),
                "{q:?}"
            );
            assert_eq!(
                conv2d_backward_filter(&q, &xl, &dyl).unwrap(),
                to_nhwc(&dw, p.c_out, p.c_in, p.kh, p.kw),
                "{q:?}"
            );
            let colsl = im2col(&q, &xl).unwrap();
            let cl = values(round + 7777, colsl.len());
            let xcl = col2im(&q, &cl).unwrap();
            assert!(rel(dot(&colsl, &cl), dot(&xl, &xcl)) <= 1e-12, "{q:?}");
        }
    }

    /// The im2col formulation of the data gradient: column matrices from the filter and dy
    /// (one product per image), then col2im, equal the gather reference.
    #[test]
    fn data_gradient_is_gemm_then_col2im() {
        let mut d = Dice(5);
        for round in 0..60u64 {
            let format = if round % 2 == 0 { Nchw } else { Nhwc };
            let p = random_problem(&mut d, format);
            let (oh, ow) = p.out_hw().unwrap();
            let (pixels, taps) = (oh * ow, p.c_in * p.kh * p.kw);
            let w = values(round + 1, p.w_len().unwrap());
            let dy = values(round + 2, p.y_len().unwrap());
            let mut cols = vec![0.0; p.n * pixels * taps];
            for b in 0..p.n {
                for q in 0..taps {
                    for px in 0..pixels {
                        let mut acc = 0.0;
                        for k in 0..p.c_out {
                            let dyv = match format {
                                Nchw => dy[(b * p.c_out + k) * pixels + px],
                                Nhwc => dy[(b * pixels + px) * p.c_out + k],
                            };
                            // The filter is a [c_out][K] matrix in both formats.
                            acc += dyv * w[k * taps + q];
                        }
                        let at = match format {
                            Nchw => (b * taps + q) * pixels + px,
                            Nhwc => (b * pixels + px) * taps + q,
                        };
                        cols[at] = acc;
                    }
                }
            }
            let want = conv2d_backward_data(&p, &dy, &w).unwrap();
            let got = col2im(&p, &cols).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 1e-12, "{p:?} dx[{i}]: {g} vs {w}");
            }
        }
    }

    #[test]
    fn gradient_errors_name_the_argument() {
        let p = Conv2d {
            n: 1,
            c_in: 1,
            h: 3,
            w: 3,
            c_out: 1,
            kh: 2,
            kw: 2,
            stride: (1, 1),
            pad: (0, 0),
            dilation: (1, 1),
            format: Nchw,
        };
        let arg = |r: Result<Vec<f64>>| r.unwrap_err().argument().map(str::to_owned);
        assert_eq!(
            arg(conv2d_backward_data(&p, &[0.0; 3], &[0.0; 4])).as_deref(),
            Some("dy")
        );
        assert_eq!(
            arg(conv2d_backward_data(&p, &[0.0; 4], &[0.0; 5])).as_deref(),
            Some("w")
        );
        assert_eq!(
            arg(conv2d_backward_filter(&p, &[0.0; 8], &[0.0; 4])).as_deref(),
            Some("x")
        );
        assert_eq!(
            arg(conv2d_backward_filter(&p, &[0.0; 9], &[0.0; 5])).as_deref(),
            Some("dy")
        );
        assert_eq!(arg(col2im(&p, &[0.0; 15])).as_deref(), Some("cols"));
        assert_eq!(
            arg(conv2d_backward_data(
                &Conv2d { kh: 4, ..p },
                &[0.0; 4],
                &[0.0; 4]
            ))
            .as_deref(),
            Some("kh")
        );
        assert_eq!(
            arg(conv2d_backward_filter(
                &Conv2d {
                    stride: (0, 1),
                    ..p
                },
                &[0.0; 9],
                &[0.0; 4]
            ))
            .as_deref(),
            Some("stride")
        );
        assert_eq!(col2im(&p, &[1.0; 16]).unwrap().len(), 9);
    }

    /// Counts that overflow usize while the given buffers are short are errors naming the
    /// tensor (they used to abort on a saturated allocation or an overflowing multiply).
    #[test]
    fn overflowing_counts_are_errors_not_panics() {
        let big = 1usize << 33;
        let one = Conv2d {
            n: 1,
            c_in: 1,
            h: 1,
            w: 1,
            c_out: 1,
            kh: 1,
            kw: 1,
            stride: (1, 1),
            pad: (0, 0),
            dilation: (1, 1),
            format: Nhwc,
        };
        let arg = |r: Result<Vec<f64>>| r.unwrap_err().argument().map(str::to_owned);
        // A huge filter whose single output pixel (huge stride) keeps y at one element.
        let wide_filter = Conv2d {
            kh: big,
            kw: big,
            pad: (big, big),
            stride: (big << 7, big << 7),
            ..one
        };
        assert_eq!(wide_filter.y_len().unwrap(), 1);
        let got = conv2d_backward_filter(&wide_filter, &[1.0], &[1.0]);
        assert_eq!(arg(got).as_deref(), Some("w"));
        assert_eq!(arg(conv2d(&wide_filter, &[1.0], &[])).as_deref(), Some("w"));
        // A huge input read by one tap.
        let wide_input = Conv2d {
            h: big,
            w: big,
            stride: (big << 7, big << 7),
            ..one
        };
        assert_eq!(wide_input.y_len().unwrap(), 1);
        let got = conv2d_backward_data(&wide_input, &[1.0], &[1.0]);
        assert_eq!(arg(got).as_deref(), Some("x"));
        assert_eq!(
            arg(conv2d_via_gemm(&wide_input, &[], &[1.0])).as_deref(),
            Some("x")
        );
        // col2im checks no y length: the pixel count itself overflows.
        let many_pixels = Conv2d {
            h: big,
            w: big,
            ..one
        };
        assert_eq!(arg(col2im(&many_pixels, &[])).as_deref(), Some("n"));
    }
}
