//! From a tensor's `(shape, axis)` to the 4-D `(n, c, h, w)` and memory format that cuDNN's
//! BatchNorm descriptors take — OneFlow's inference rule, for any rank and any channel axis.
//! Pure: no GPU calls, tested on the CPU.
//!
//! The rule (OneFlow's `InferDimSizeAndDataFormat`):
//! - if every dim after `axis` has extent 1, the channel is innermost in memory, so the tensor is
//!   described as **NHWC** with `n = shape[0]`, `h = prod(shape[1..axis])`, `w = 1`,
//!   `c = shape[axis]` (for `axis == 0`: `n = h = 1`);
//! - otherwise as **NCHW** with `n = prod(shape[..axis])`, `c = shape[axis]`,
//!   `h = prod(shape[axis+1..])`, `w = 1`.

use std::fmt;

use crate::error::{Error, Result};

/// Memory format of a 4-D descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorFormat {
    /// Channels innermost (channels-last).
    Nhwc,
    /// Channels outside the spatial dims (channels-first).
    Nchw,
}

impl TensorFormat {
    /// `nhwc` / `nchw`.
    pub const fn name(self) -> &'static str {
        match self {
            TensorFormat::Nhwc => "nhwc",
            TensorFormat::Nchw => "nchw",
        }
    }

    /// cuDNN's format enum.
    pub fn cudnn(self) -> cudarc::cudnn::sys::cudnnTensorFormat_t {
        use cudarc::cudnn::sys::cudnnTensorFormat_t as F;
        match self {
            TensorFormat::Nhwc => F::CUDNN_TENSOR_NHWC,
            TensorFormat::Nchw => F::CUDNN_TENSOR_NCHW,
        }
    }
}

impl fmt::Display for TensorFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The 4-D view of a tensor for a per-channel operation along `axis`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChannelLayout {
    /// Outer (batch) extent.
    pub n: i32,
    /// Channels.
    pub c: i32,
    /// Spatial extent (all spatial dims folded).
    pub h: i32,
    /// Always 1 under this rule; kept so the descriptor call reads naturally.
    pub w: i32,
    /// Memory format.
    pub format: TensorFormat,
    /// Rank of the original shape.
    pub rank: usize,
}

impl ChannelLayout {
    /// Number of elements (`n * c * h * w`).
    pub fn numel(&self) -> usize {
        self.n as usize * self.c as usize * self.h as usize * self.w as usize
    }

    /// Elements per channel (`n * h * w`): the count BatchNorm averages over.
    pub fn per_channel(&self) -> usize {
        self.n as usize * self.h as usize * self.w as usize
    }
}

#[cfg(test)]
impl ChannelLayout {
    /// The unit tests' example: 8 images of 64 channels of 14 x 14 in `format`, as
    /// [`infer_channel_layout`] views them.
    pub(crate) fn example(format: TensorFormat) -> ChannelLayout {
        ChannelLayout {
            n: 8,
            c: 64,
            h: 196,
            w: 1,
            format,
            rank: 4,
        }
    }
}

impl fmt::Display for ChannelLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} n={} c={} h={} w={}",
            self.format, self.n, self.c, self.h, self.w
        )
    }
}

/// Product of `dims` as `i32`, or an error naming `what` when it does not fit, with the real
/// product (computed in `u128`, checked: a saturated count would misreport the shape).
fn product_i32(dims: &[usize], what: &str) -> Result<i32> {
    let p = dims
        .iter()
        .try_fold(1u128, |p, &d| p.checked_mul(d as u128));
    let Some(p) = p else {
        return Err(Error::invalid(
            "shape",
            format!("{what} overflows (more than 2^128; cuDNN's 4-D descriptors take i32)"),
        ));
    };
    i32::try_from(p).map_err(|_| {
        Error::invalid(
            "shape",
            format!("{what} = {p} does not fit in i32 (cuDNN's 4-D descriptors take i32)"),
        )
    })
}

/// Checks that `shape` is non-empty, `axis < shape.len()` and no extent is zero; errors name
/// `shape`, `axis` or `shape[i]`. Shared by every API that takes `(shape, axis)`.
pub fn check_shape_axis(shape: &[usize], axis: usize) -> Result<()> {
    if shape.is_empty() {
        return Err(Error::invalid("shape", "is empty (rank 0)"));
    }
    if axis >= shape.len() {
        return Err(Error::invalid(
            "axis",
            format!("{axis} is out of range for a shape of rank {}", shape.len()),
        ));
    }
    if let Some(i) = shape.iter().position(|&d| d == 0) {
        return Err(Error::invalid(
            format!("shape[{i}]"),
            "is 0: zero-size tensors are not supported",
        ));
    }
    Ok(())
}

/// Validates `shape` and `axis` and infers the 4-D layout by OneFlow's rule.
///
/// Errors (as [`Error::InvalidArgument`]): empty shape, `axis >= rank`, a zero extent, or an
/// element count that does not fit in `i32`.
pub fn infer_channel_layout(shape: &[usize], axis: usize) -> Result<ChannelLayout> {
    check_shape_axis(shape, axis)?;
    // Also bounds every partial product below.
    product_i32(shape, "the element count")?;

    let c = shape[axis] as i32;
    let trailing = product_i32(&shape[axis + 1..], "the product of the dims after axis")?;
    let layout = if trailing == 1 {
        let (n, h) = if axis == 0 {
            (1, 1)
        } else {
            (shape[0] as i32, product_i32(&shape[1..axis], "h")?)
        };
        ChannelLayout {
            n,
            c,
            h,
            w: 1,
            format: TensorFormat::Nhwc,
            rank: shape.len(),
        }
    } else {
        ChannelLayout {
            n: product_i32(&shape[..axis], "n")?,
            c,
            h: trailing,
            w: 1,
            format: TensorFormat::Nchw,
            rank: shape.len(),
        }
    };
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use TensorFormat::*;

    fn l(shape: &[usize], axis: usize) -> (i32, i32, i32, i32, TensorFormat) {
        let r = infer_channel_layout(shape, axis).unwrap();
        (r.n, r.c, r.h, r.w, r.format)
    }

    #[test]
    fn channels_first_4d() {
        assert_eq!(l(&[16, 32, 112, 112], 1), (16, 32, 112 * 112, 1, Nchw));
    }

    #[test]
    fn channels_last_4d() {
        assert_eq!(l(&[64, 56, 56, 256], 3), (64, 256, 56 * 56, 1, Nhwc));
    }

    #[test]
    fn two_d_is_nhwc_with_unit_spatial() {
        assert_eq!(l(&[65536, 256], 1), (65536, 256, 1, 1, Nhwc));
    }

    #[test]
    fn axis_zero() {
        assert_eq!(l(&[7], 0), (1, 7, 1, 1, Nhwc));
        assert_eq!(l(&[7, 1, 1], 0), (1, 7, 1, 1, Nhwc));
        assert_eq!(l(&[7, 3, 5], 0), (1, 7, 15, 1, Nchw));
    }

    #[test]
    fn trailing_unit_dims_make_nhwc() {
        // (N, C, 1, 1): dims after axis 1 are all 1 → NHWC with h = 1.
        assert_eq!(l(&[8, 16, 1, 1], 1), (8, 16, 1, 1, Nhwc));
        // 5-D channels-last.
        assert_eq!(l(&[2, 4, 6, 8, 10], 4), (2, 10, 4 * 6 * 8, 1, Nhwc));
        // 5-D channels-first.
        assert_eq!(l(&[2, 4, 6, 8, 10], 1), (2, 4, 6 * 8 * 10, 1, Nchw));
        // 3-D, axis in the middle.
        assert_eq!(l(&[3, 5, 7], 1), (3, 5, 7, 1, Nchw));
        // Middle axis with inner extent 1.
        assert_eq!(l(&[3, 5, 7, 1], 2), (3, 7, 5, 1, Nhwc));
        // N = 1 and H = W = 1.
        assert_eq!(l(&[1, 32, 1, 1], 1), (1, 32, 1, 1, Nhwc));
        assert_eq!(l(&[1, 32, 4, 4], 1), (1, 32, 16, 1, Nchw));
    }

    #[test]
    fn errors_name_the_argument() {
        assert_eq!(
            infer_channel_layout(&[], 0).unwrap_err().argument(),
            Some("shape")
        );
        assert_eq!(
            infer_channel_layout(&[2, 3], 2).unwrap_err().argument(),
            Some("axis")
        );
        assert_eq!(
            infer_channel_layout(&[2, 0, 3], 1).unwrap_err().argument(),
            Some("shape[1]")
        );
        let e = infer_channel_layout(&[1 << 16, 1 << 16], 1).unwrap_err();
        assert_eq!(e.argument(), Some("shape"));
        assert!(e.to_string().contains("i32"));
        // Just fits.
        assert!(infer_channel_layout(&[(i32::MAX as usize)], 0).is_ok());
        assert!(infer_channel_layout(&[(i32::MAX as usize) + 1], 0).is_err());
        // The error reports the real count, not a saturated one, and an overflow as such.
        let e = infer_channel_layout(&[usize::MAX, 2], 1).unwrap_err();
        assert!(e.to_string().contains("= 36893488147419103230 "), "{e}");
        let e = infer_channel_layout(&[usize::MAX, usize::MAX, 2], 1).unwrap_err();
        assert_eq!(e.argument(), Some("shape"));
        assert!(e.to_string().contains("overflows"), "{e}");
        assert!(!e.to_string().contains(&usize::MAX.to_string()), "{e}");
    }

    proptest! {
        #[test]
        fn layout_properties(shape in prop::collection::vec(1usize..9, 1..7), axis_seed in 0usize..100) {
            let axis = axis_seed % shape.len();
            let r = infer_channel_layout(&shape, axis).unwrap();
            let total: usize = shape.iter().product();
            prop_assert_eq!(r.numel(), total);
            prop_assert_eq!(r.c as usize, shape[axis]);
            prop_assert_eq!(r.w, 1);
            prop_assert_eq!(r.rank, shape.len());
            let trailing: usize = shape[axis + 1..].iter().product();
            prop_assert_eq!(r.format == Nhwc, trailing == 1);
            if r.format == Nchw {
                prop_assert_eq!(r.h as usize, trailing);
                prop_assert_eq!(r.n as usize, shape[..axis].iter().product::<usize>());
            } else if axis > 0 {
                prop_assert_eq!(r.n as usize, shape[0]);
            } else {
                prop_assert_eq!((r.n, r.h), (1, 1));
            }
        }

        #[test]
        fn memory_order_is_preserved(shape in prop::collection::vec(1usize..6, 1..6), axis_seed in 0usize..100) {
            // The descriptor must address the same memory as the row-major tensor: the linear
            // offset of (outer, c, inner) under the inferred format equals the row-major one.
            let axis = axis_seed % shape.len();
            let r = infer_channel_layout(&shape, axis).unwrap();
            let outer: usize = shape[..axis].iter().product();
            let inner: usize = shape[axis + 1..].iter().product();
            let c = shape[axis];
            for o in 0..outer {
                for ch in 0..c {
                    for i in 0..inner {
                        let row_major = (o * c + ch) * inner + i;
                        // decompose into (n, h) for the 4-D descriptor
                        let (n, h) = match r.format {
                            Nchw => (o, i),
                            Nhwc => if axis == 0 { (0, 0) } else { (o / (outer / shape[0]), o % (outer / shape[0])) },
                        };
                        let off = match r.format {
                            Nchw => ((n * c + ch) * r.h as usize + h) * r.w as usize,
                            Nhwc => (n * r.h as usize + h) * c + ch,
                        };
                        prop_assert_eq!(off, row_major);
                    }
                }
            }
        }
    }
}
