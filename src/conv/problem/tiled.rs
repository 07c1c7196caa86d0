//! The filter gradient over 2x2 spatial tiles (the `cudnn_tiled` path): at stride 1 the sum over
//! output positions that makes dw splits into four quarters of the output, each a problem of its
//! own with its input window (halo and padding materialized, padding 0). Stacking the quarters
//! as the batch gives one problem with 4n images of a quarter of the area and the same dw. Why:
//! on the H100 cuDNN's true-f32 filter-gradient engines ran the 3x3 64-channel layer at 56x56
//! (batch 32) in 311-320 µs, and the same work as 128 images of 28x28 in 166 µs.
//! Pure: no GPU calls.

use super::shape::ConvShape;
use crate::dtype::DType;

/// The smallest output extent the path splits (a quarter must keep at least 16 rows and
/// columns: below, cuDNN's engines are not the slow ones this path avoids).
pub(crate) const TILED_MIN_OUT: usize = 32;

/// Why the filter gradient of `s` (output `out_hw`) in `dtype` cannot run over 2x2 tiles, or
/// `None` when it can: f32 (f16 and bf16 engines run such layers fast), stride 1 and dilation
/// 1, an output of at least [`TILED_MIN_OUT`] in both dimensions.
pub(crate) fn tiled_refusal(s: &ConvShape, dtype: DType, out_hw: (usize, usize)) -> Option<String> {
    if dtype != DType::F32 {
        return Some(format!(
            "f32 only: for {dtype} cuDNN's tensor-core filter gradients have nothing to gain"
        ));
    }
    if s.stride != (1, 1) || s.dilation != (1, 1) {
        return Some(format!(
            "stride {:?}, dilation {:?}: the tiles are cut at stride 1 and dilation 1",
            s.stride, s.dilation
        ));
    }
    if out_hw.0 < TILED_MIN_OUT || out_hw.1 < TILED_MIN_OUT {
        return Some(format!(
            "output {}x{}: tiles are cut from outputs of at least {TILED_MIN_OUT}x{TILED_MIN_OUT}",
            out_hw.0, out_hw.1
        ));
    }
    None
}

/// A quarter's output extent: `ceil(out / 2)` per axis (the last quarter's rows past the output
/// are zero in the tiled dy, so they add nothing).
pub(crate) fn quarter(out_hw: (usize, usize)) -> (usize, usize) {
    (out_hw.0.div_ceil(2), out_hw.1.div_ceil(2))
}

/// The tiled problem of an eligible one ([`tiled_refusal`] is `None`): 4n images (image
/// `4 * n + 2 * ty + tx` is quarter `(ty, tx)` of image `n`), each a quarter's input window
/// (`qh + kh - 1` x `qw + kw - 1`), no padding, the same channels, filter and format.
pub(crate) fn tiled_shape(s: &ConvShape, out_hw: (usize, usize)) -> ConvShape {
    let (qh, qw) = quarter(out_hw);
    ConvShape {
        n: 4 * s.n,
        h: qh + s.kh - 1,
        w: qw + s.kw - 1,
        pad: (0, 0),
        ..*s
    }
}

/// Bytes of the tiled x in the scratch, rounded up to 256 so that the tiled dy after it starts
/// aligned as cuDNN's allocations do.
pub(crate) fn tiled_x_bytes(s: &ConvShape, out_hw: (usize, usize)) -> usize {
    let t = tiled_shape(s, out_hw);
    (t.n * t.c_in * t.h * t.w * std::mem::size_of::<f32>()).next_multiple_of(256)
}

/// Bytes of f32 scratch the tiled x and dy take.
pub(crate) fn tiled_bytes(s: &ConvShape, out_hw: (usize, usize)) -> usize {
    let (qh, qw) = quarter(out_hw);
    let dy = 4 * s.n * s.c_out * qh * qw;
    tiled_x_bytes(s, out_hw) + dy * std::mem::size_of::<f32>()
}

/// The original input coordinate that element `(i, j)` of quarter `(ty, tx)`'s window holds
/// (`None`: padding, a zero). The tiling kernel's rule (`kernels/conv_tiled.cu`), checked here.
#[cfg(test)]
fn window_source(
    s: &ConvShape,
    out_hw: (usize, usize),
    (ty, tx): (usize, usize),
    (i, j): (usize, usize),
) -> Option<(usize, usize)> {
    let (qh, qw) = quarter(out_hw);
    let r = (ty * qh + i) as isize - s.pad.0 as isize;
    let c = (tx * qw + j) as isize - s.pad.1 as isize;
    (r >= 0 && c >= 0 && (r as usize) < s.h && (c as usize) < s.w)
        .then_some((r as usize, c as usize))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::TensorFormat;

    fn conv(h: usize, w: usize, k: usize, pad: usize) -> ConvShape {
        ConvShape {
            n: 2,
            c_in: 3,
            h,
            w,
            c_out: 4,
            kh: k,
            kw: k,
            stride: (1, 1),
            pad: (pad, pad),
            dilation: (1, 1),
            format: TensorFormat::Nchw,
        }
    }

    /// The tiled problem's filter gradient is the original's, term for term: every product
    /// dy(ho, wo) x(ho + r - p, wo + s - p) of the original appears exactly once among the
    /// quarters' products (zero-padded terms included as zeros), and no other.
    #[test]
    fn the_quarters_hold_every_product_once() {
        for (h, w, k, pad) in [
            (33, 40, 3, 1),
            (32, 35, 3, 0),
            (34, 34, 5, 2),
            (40, 33, 1, 0),
        ] {
            let s = conv(h, w, k, pad);
            let out = s.out_hw().unwrap();
            let t = tiled_shape(&s, out);
            assert_eq!(t.out_hw().unwrap(), quarter(out), "{s:?}");
            let (qh, qw) = quarter(out);
            let mut seen = std::collections::HashMap::new();
            for ty in 0..2 {
                for tx in 0..2 {
                    for i in 0..qh {
                        for j in 0..qw {
                            let (ho, wo) = (ty * qh + i, tx * qw + j);
                            if ho >= out.0 || wo >= out.1 {
                                continue; // a zero dy row or column of the last quarter
                            }
                            for r in 0..k {
                                for c in 0..k {
                                    let src = window_source(&s, out, (ty, tx), (i + r, j + c));
                                    *seen.entry((ho, wo, r, c, src)).or_insert(0) += 1;
                                }
                            }
                        }
                    }
                }
            }
            for ho in 0..out.0 {
                for wo in 0..out.1 {
                    for r in 0..k {
                        for c in 0..k {
                            let (y, x) = (
                                (ho + r) as isize - pad as isize,
                                (wo + c) as isize - pad as isize,
                            );
                            let src = (y >= 0 && x >= 0 && (y as usize) < h && (x as usize) < w)
                                .then_some((y as usize, x as usize));
                            assert_eq!(seen.remove(&(ho, wo, r, c, src)), Some(1), "{s:?}");
                        }
                    }
                }
            }
            assert!(seen.is_empty(), "{s:?}: extra products {seen:?}");
        }
    }

    #[test]
    fn refusals_and_sizes() {
        let s = conv(56, 56, 3, 1);
        let out = s.out_hw().unwrap();
        assert_eq!(tiled_refusal(&s, DType::F32, out), None);
        let t = tiled_shape(&s, out);
        assert_eq!((t.n, t.h, t.w, t.pad), (8, 30, 30, (0, 0)));
        assert_eq!(
            tiled_x_bytes(&s, out),
            (8 * 3 * 30 * 30 * 4usize).next_multiple_of(256)
        );
        assert_eq!(
            tiled_bytes(&s, out),
            tiled_x_bytes(&s, out) + 8 * 4 * 28 * 28 * 4
        );
        assert!(tiled_refusal(&s, DType::BF16, out)
            .unwrap()
            .contains("f32 only"));
        let small = conv(28, 28, 3, 1);
        assert!(tiled_refusal(&small, DType::F32, (28, 28))
            .unwrap()
            .contains("at least"));
        let strided = ConvShape {
            stride: (2, 2),
            ..s
        };
        assert!(tiled_refusal(&strided, DType::F32, (28, 28))
            .unwrap()
            .contains("stride"));
    }
}
