//! The forward convolution as a data gradient (the `cudnn_dual` path): for stride 1, a forward
//! convolution of x with filter w equals the data gradient of the *dual* problem with dy = x and
//! the filter rotated by 180 degrees with its channel axes swapped. With `y[i] = Σ_r x[i - p +
//! r·d] w[r]` and the data gradient `dx[i] = Σ_r dy[i + p' - r·d] W[r]`, taking `p' = d(k-1) - p`
//! and `W[r] = w[k-1-r]` gives `dx = y`. Why: on the H100 cuDNN's f32 data-gradient engines
//! run some 3x3 layers 1.4–1.6x faster than its forward engines for the same arithmetic.
//! Pure: no GPU calls.

use super::shape::ConvShape;
use crate::dtype::DType;

/// Why the forward of `s` in `dtype` cannot run as the data gradient of its dual problem, or
/// `None` when it can: stride 1 on both axes and a padding of at most the dilated filter's
/// extent minus one (`p <= d(k-1)`, so that the dual's padding `d(k-1) - p` is not negative).
/// f32 only: for f16 and bf16 cuDNN's forward and data-gradient tensor-core engines ran alike
/// (H100, 3x3 64@56 batch 32: 27.9 against 27.6 µs), so the path would only lengthen first
/// calls.
pub(crate) fn dual_refusal(s: &ConvShape, dtype: DType) -> Option<String> {
    if dtype != DType::F32 {
        return Some(format!(
            "f32 only: for {dtype} cuDNN's forward and data-gradient engines run alike (H100: \
             27.9 against 27.6 us at 3x3 64@56), nothing to gain"
        ));
    }
    if s.stride != (1, 1) {
        return Some(format!(
            "stride {:?}: the forward equals a data gradient only at stride 1",
            s.stride
        ));
    }
    let reach = |k: usize, d: usize| d * (k.max(1) - 1);
    if s.pad.0 > reach(s.kh, s.dilation.0) || s.pad.1 > reach(s.kw, s.dilation.1) {
        return Some(format!(
            "padding {:?} exceeds the dilated filter's reach ({}, {}): the dual problem's \
             padding d(k-1) - p would be negative",
            s.pad,
            reach(s.kh, s.dilation.0),
            reach(s.kw, s.dilation.1)
        ));
    }
    None
}

/// The dual problem of an eligible forward ([`dual_refusal`] is `None`): its input is the
/// forward's output (`c_out` channels, the output's extent), its output the forward's input
/// (`c_in` channels, `h x w`), the same filter extent and dilation, stride 1, padding
/// `d(k-1) - p`. Its data gradient, run with dy = x and the rotated filter
/// ([`dual_filter_index`]), writes the forward's y into its dx.
pub(crate) fn dual_shape(s: &ConvShape, out_hw: (usize, usize)) -> ConvShape {
    ConvShape {
        n: s.n,
        c_in: s.c_out,
        h: out_hw.0,
        w: out_hw.1,
        c_out: s.c_in,
        kh: s.kh,
        kw: s.kw,
        stride: (1, 1),
        pad: (
            s.dilation.0 * (s.kh - 1) - s.pad.0,
            s.dilation.1 * (s.kw - 1) - s.pad.1,
        ),
        dilation: s.dilation,
        format: s.format,
    }
}

/// Where element `i` of the dual filter comes from in the forward's filter, for a filter
/// `[k][c][kh][kw]` (KCRS, `nhwc == false`) or `[k][kh][kw][c]` (KRSC): the dual filter has
/// `c` filters of `k` channels, `W[c][k][r][s] = w[k][c][kh-1-r][kw-1-s]` (in the same layout).
/// The rule `kernels/conv_dual.cu` applies, here for the CPU tests. Pure.
#[cfg(test)]
pub(crate) fn dual_filter_index(
    i: usize,
    (k, c, kh, kw): (usize, usize, usize, usize),
    nhwc: bool,
) -> usize {
    if nhwc {
        // Dual KRSC: [c][r][s][k].
        let kk = i % k;
        let ss = (i / k) % kw;
        let rr = (i / (k * kw)) % kh;
        let cc = i / (k * kw * kh);
        ((kk * kh + (kh - 1 - rr)) * kw + (kw - 1 - ss)) * c + cc
    } else {
        // Dual KCRS: [c][k][r][s].
        let ss = i % kw;
        let rr = (i / kw) % kh;
        let kk = (i / (kw * kh)) % k;
        let cc = i / (kw * kh * k);
        ((kk * c + cc) * kh + (kh - 1 - rr)) * kw + (kw - 1 - ss)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::TensorFormat;

    fn shape(pad: (usize, usize), dilation: (usize, usize), stride: (usize, usize)) -> ConvShape {
        ConvShape {
            n: 2,
            c_in: 3,
            h: 9,
            w: 11,
            c_out: 5,
            kh: 3,
            kw: 5,
            stride,
            pad,
            dilation,
            format: TensorFormat::Nchw,
        }
    }

    /// The dual problem's output has the forward's input extent: its data gradient is x-shaped
    /// where it reads the forward's y, and the other way round.
    #[test]
    fn the_dual_problem_swaps_input_and_output() {
        for (pad, dil) in [
            ((1, 2), (1, 1)),
            ((0, 0), (1, 1)),
            ((2, 4), (2, 1)),
            ((0, 4), (1, 1)),
        ] {
            let s = shape(pad, dil, (1, 1));
            assert_eq!(dual_refusal(&s, DType::F32), None, "{s:?}");
            let out = s.out_hw().unwrap();
            let d = dual_shape(&s, out);
            assert_eq!((d.h, d.w, d.c_in, d.c_out), (out.0, out.1, s.c_out, s.c_in));
            assert_eq!(d.out_hw().unwrap(), (s.h, s.w), "{s:?} -> {d:?}");
        }
    }

    #[test]
    fn refusals_name_the_reason() {
        let why = |s: ConvShape, t| dual_refusal(&s, t).unwrap_or_default();
        assert!(why(shape((1, 1), (1, 1), (2, 1)), DType::F32).contains("stride"));
        assert!(why(shape((3, 1), (1, 1), (1, 1)), DType::F32).contains("padding"));
        assert!(why(shape((1, 1), (1, 1), (1, 1)), DType::F16).contains("f32 only"));
    }

    /// The rotation is a permutation, and the dual of the dual filter is the filter.
    #[test]
    fn the_dual_filter_is_a_rotated_transpose() {
        let (k, c, kh, kw) = (4, 3, 3, 2);
        for nhwc in [false, true] {
            let n = k * c * kh * kw;
            let mut seen = vec![false; n];
            for i in 0..n {
                let j = dual_filter_index(i, (k, c, kh, kw), nhwc);
                assert!(!seen[j]);
                seen[j] = true;
                // The dual filter has c filters of k channels: its own dual is the original.
                assert_eq!(dual_filter_index(j, (c, k, kh, kw), nhwc), i);
            }
        }
        // KCRS: W[c=1][k=2][r=0][s=1] = w[k=2][c=1][r=2][s=0].
        let i = ((k + 2) * kh) * kw + 1;
        assert_eq!(
            dual_filter_index(i, (k, c, kh, kw), false),
            ((2 * c + 1) * kh + 2) * kw
        );
    }
}
