//! The convolution problem: sizes, stride, padding, dilation and memory format of one 2-D
//! convolution layer. The operation and the layouts are documented with its f64 reference
//! (`nnfuse::reference::conv`, which imports this file, never the other way).

use crate::error::{Error, Result};
use crate::layout::TensorFormat;

/// One 2-D convolution problem (the layouts and the formula: `nnfuse::reference::conv`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConvShape {
    /// Batch size.
    pub n: usize,
    /// Input channels.
    pub c_in: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Output channels (filters).
    pub c_out: usize,
    /// Filter height.
    pub kh: usize,
    /// Filter width.
    pub kw: usize,
    /// `(vertical, horizontal)` stride.
    pub stride: (usize, usize),
    /// `(vertical, horizontal)` zero padding, added on both sides.
    pub pad: (usize, usize),
    /// `(vertical, horizontal)` dilation (1 = dense filter).
    pub dilation: (usize, usize),
    /// Memory format of x, w and y.
    pub format: TensorFormat,
}

/// Output extent along one spatial axis, or an error naming `k_name`, `stride` or `dilation`.
fn out_extent(
    input: usize,
    k: usize,
    stride: usize,
    pad: usize,
    dilation: usize,
    k_name: &str,
    in_name: &str,
) -> Result<usize> {
    let overflow = || Error::invalid(k_name, "the padded or dilated extent overflows usize");
    let padded = pad
        .checked_mul(2)
        .and_then(|p| p.checked_add(input))
        .ok_or_else(overflow)?;
    let extent = (k - 1)
        .checked_mul(dilation)
        .and_then(|e| e.checked_add(1))
        .ok_or_else(overflow)?;
    if extent > padded {
        return Err(Error::invalid(
            k_name,
            format!(
                "the dilated filter extent {extent} exceeds the padded input {in_name} {padded}: \
                 the output would be empty"
            ),
        ));
    }
    Ok((padded - extent) / stride + 1)
}

/// `Some(product)` or `None` on overflow.
fn product(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |p, &d| p.checked_mul(d))
}

impl ConvShape {
    /// A square `r`×`r` convolution of `n` images of `h`×`h` with `c_in` channels into `c_out`
    /// channels: stride 1, dilation 1, padding `r / 2` (the output keeps the input's size for
    /// odd `r`).
    ///
    /// ```
    /// use nnfuse::conv::ConvShape;
    /// use nnfuse::TensorFormat;
    /// let s = ConvShape::square(32, 64, 56, 64, 3, TensorFormat::Nhwc);
    /// assert_eq!(s.out_hw()?, (56, 56));
    /// # Ok::<(), nnfuse::Error>(())
    /// ```
    pub fn square(
        n: usize,
        c_in: usize,
        h: usize,
        c_out: usize,
        r: usize,
        format: crate::TensorFormat,
    ) -> ConvShape {
        ConvShape {
            n,
            c_in,
            h,
            w: h,
            c_out,
            kh: r,
            kw: r,
            stride: (1, 1),
            pad: (r / 2, r / 2),
            dilation: (1, 1),
            format,
        }
    }

    /// Validates every parameter and returns the output size `(oh, ow)`.
    ///
    /// Errors (as [`Error::InvalidArgument`], naming the field): a zero `n`, `c_in`, `h`, `w`,
    /// `c_out`, `kh` or `kw`; a zero component of `stride` or `dilation`; a dilated filter
    /// larger than the padded input (named `kh` or `kw`: the output would be empty).
    pub fn out_hw(&self) -> Result<(usize, usize)> {
        for (name, v) in [
            ("n", self.n),
            ("c_in", self.c_in),
            ("h", self.h),
            ("w", self.w),
            ("c_out", self.c_out),
            ("kh", self.kh),
            ("kw", self.kw),
        ] {
            if v == 0 {
                return Err(Error::invalid(name, "is 0"));
            }
        }
        if self.stride.0 == 0 || self.stride.1 == 0 {
            return Err(Error::invalid(
                "stride",
                format!("{:?} has a zero component", self.stride),
            ));
        }
        if self.dilation.0 == 0 || self.dilation.1 == 0 {
            return Err(Error::invalid(
                "dilation",
                format!("{:?} has a zero component", self.dilation),
            ));
        }
        let oh = out_extent(
            self.h,
            self.kh,
            self.stride.0,
            self.pad.0,
            self.dilation.0,
            "kh",
            "height",
        )?;
        let ow = out_extent(
            self.w,
            self.kw,
            self.stride.1,
            self.pad.1,
            self.dilation.1,
            "kw",
            "width",
        )?;
        Ok((oh, ow))
    }

    /// Elements of x (`n * c_in * h * w`).
    ///
    /// Errors: `x` (named) when the count overflows usize.
    pub fn x_len(&self) -> Result<usize> {
        product(&[self.n, self.c_in, self.h, self.w])
            .ok_or_else(|| Error::invalid("x", "the element count n*c_in*h*w overflows usize"))
    }

    /// Elements of the filter (`c_out * c_in * kh * kw`).
    ///
    /// Errors: `w` (named: the filter) when the count overflows usize.
    pub fn w_len(&self) -> Result<usize> {
        product(&[self.c_out, self.c_in, self.kh, self.kw]).ok_or_else(|| {
            Error::invalid(
                "w",
                "the filter's element count c_out*c_in*kh*kw overflows usize",
            )
        })
    }

    /// Elements of y (`n * c_out * oh * ow`), validating the problem as [`ConvShape::out_hw`].
    pub fn y_len(&self) -> Result<usize> {
        let (oh, ow) = self.out_hw()?;
        product(&[self.n, self.c_out, oh, ow])
            .ok_or_else(|| Error::invalid("n", "the output element count overflows usize"))
    }
}

/// Largest extent nnfuse's own kernels index with 32-bit signed integers.
pub(crate) const INT_EXTENT: usize = i32::MAX as usize;

/// Why `kernel` cannot index these named extents with 32-bit integers (those above
/// [`INT_EXTENT`], each named with its value); `None` when all fit. Pure.
pub(crate) fn extents_refusal(kernel: &str, extents: &[(&str, usize)]) -> Option<String> {
    let over: Vec<String> = extents
        .iter()
        .filter(|(_, v)| *v > INT_EXTENT)
        .map(|(n, v)| format!("{n} = {v}"))
        .collect();
    (!over.is_empty()).then(|| {
        format!(
            "{kernel} indexes with 32-bit extents (at most {INT_EXTENT}): {}",
            over.join(", ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_over_32_bits_are_named_with_their_values() {
        assert_eq!(extents_refusal("k", &[("n", 4), ("h", INT_EXTENT)]), None);
        let why = extents_refusal(
            "the kernel",
            &[("n", 4), ("h", INT_EXTENT + 1), ("w", usize::MAX)],
        )
        .unwrap();
        assert!(
            why.starts_with("the kernel indexes with 32-bit extents"),
            "{why}"
        );
        assert!(why.contains(&format!("h = {}", INT_EXTENT + 1)), "{why}");
        assert!(
            why.contains(&format!("w = {}", usize::MAX)) && !why.contains("n = 4"),
            "{why}"
        );
    }

    fn shape() -> ConvShape {
        ConvShape {
            n: 2,
            c_in: 3,
            h: 5,
            w: 7,
            c_out: 4,
            kh: 3,
            kw: 3,
            stride: (1, 1),
            pad: (1, 1),
            dilation: (1, 1),
            format: TensorFormat::Nhwc,
        }
    }

    #[test]
    fn element_counts() {
        let s = shape();
        assert_eq!(s.x_len().unwrap(), 2 * 3 * 5 * 7);
        assert_eq!(s.w_len().unwrap(), 4 * 3 * 3 * 3);
        assert_eq!(s.y_len().unwrap(), 2 * 4 * 5 * 7);
    }

    /// An overflowing count is an error naming its tensor, not a saturated `usize::MAX`.
    #[test]
    fn overflowing_counts_are_errors_naming_the_tensor() {
        let big = 1usize << 33;
        let x = ConvShape {
            h: big,
            w: big,
            ..shape()
        };
        assert_eq!(x.x_len().unwrap_err().argument(), Some("x"));
        assert_eq!(x.w_len().unwrap(), 4 * 3 * 3 * 3);
        let w = ConvShape {
            kh: big,
            kw: big,
            ..shape()
        };
        assert_eq!(w.w_len().unwrap_err().argument(), Some("w"));
        assert_eq!(w.x_len().unwrap(), 2 * 3 * 5 * 7);
    }
}
