//! Pure layout arithmetic of a convolution graph: the three tensors' logical dimensions, their
//! strides in NCHW/NHWC (filters KCRS/KRSC), unique ids, and the alignment class of device
//! pointers. No cuDNN calls; tested on the CPU.
//!
//! cuDNN's graph API always takes dimensions in the logical order `[n, c, h, w]` (filters
//! `[k, c, r, s]`); the memory format is carried by the strides alone.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::TensorFormat;
use crate::reference::conv::Conv2d as ConvShape;

/// The largest pointer alignment (bytes) a plan is built for: cudnn-frontend's default, and
/// what every cudarc allocation satisfies.
pub const MAX_ALIGNMENT: u8 = 16;

/// One of the convolution's three tensors, by its role in the forward convolution. The data
/// gradient writes [`Operand::X`] (as dx) and reads [`Operand::Y`] (as dy); the filter gradient
/// writes [`Operand::W`] (as dw).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operand {
    /// x (forward, filter gradient) or dx (data gradient).
    X,
    /// w (forward, data gradient) or dw (filter gradient).
    W,
    /// y (forward) or dy (both gradients).
    Y,
}

impl Operand {
    /// The three operands in variant-pack order.
    pub const ALL: [Operand; 3] = [Operand::X, Operand::W, Operand::Y];

    /// The tensor's unique id in the graph (`CUDNN_ATTR_TENSOR_UNIQUE_ID`): fixed per role, so
    /// that the variant pack's id array is a constant.
    pub const fn uid(self) -> i64 {
        match self {
            Operand::X => 1,
            Operand::W => 2,
            Operand::Y => 3,
        }
    }

    /// `x`, `w`, `y`.
    pub const fn name(self) -> &'static str {
        match self {
            Operand::X => "x",
            Operand::W => "w",
            Operand::Y => "y",
        }
    }
}

/// Everything a backend tensor descriptor is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorSpec {
    /// Which operand.
    pub operand: Operand,
    /// `CUDNN_ATTR_TENSOR_UNIQUE_ID`.
    pub uid: i64,
    /// Logical dimensions `[n, c, h, w]` (filters `[k, c, r, s]`).
    pub dims: [i64; 4],
    /// Element strides of `dims`.
    pub strides: [i64; 4],
    /// Element type.
    pub dtype: DType,
    /// Guaranteed byte alignment of the data pointer (`CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT`).
    pub alignment: i64,
    /// A virtual tensor (an intermediate of a fused graph, never in memory).
    pub is_virtual: bool,
    /// A scalar passed by value in the variant pack.
    pub by_value: bool,
}

/// Packed element strides of logical dims `[n, c, h, w]` stored in `format`: NCHW gives
/// `[c·h·w, h·w, w, 1]`, NHWC gives `[h·w·c, 1, w·c, c]` (for a filter `[k, c, r, s]`: KCRS and
/// KRSC).
pub const fn packed_strides(format: TensorFormat, dims: [i64; 4]) -> [i64; 4] {
    let [_, c, h, w] = dims;
    match format {
        TensorFormat::Nchw => [c * h * w, h * w, w, 1],
        TensorFormat::Nhwc => [h * w * c, 1, w * c, c],
    }
}

fn dim(v: usize, name: &str) -> Result<i64> {
    i64::try_from(v).map_err(|_| Error::invalid(name, format!("{v} does not fit cuDNN's int64")))
}

/// The x, w and y tensor specs of `shape` (in [`Operand::ALL`] order) for `dtype` data whose
/// pointers are aligned to `alignment` bytes. Validates the shape ([`ConvShape::out_hw`]).
pub fn tensor_specs(shape: &ConvShape, dtype: DType, alignment: u8) -> Result<[TensorSpec; 3]> {
    let (oh, ow) = shape.out_hw()?;
    // Element counts must fit int64 too (strides are products of the dims).
    shape.y_len()?;
    if !alignment.is_power_of_two() || alignment > MAX_ALIGNMENT {
        return Err(Error::invalid(
            "alignment",
            format!("{alignment} is not a power of two up to {MAX_ALIGNMENT}"),
        ));
    }
    let n = dim(shape.n, "n")?;
    let c = dim(shape.c_in, "c_in")?;
    let k = dim(shape.c_out, "c_out")?;
    let dims = [
        (Operand::X, [n, c, dim(shape.h, "h")?, dim(shape.w, "w")?]),
        (
            Operand::W,
            [k, c, dim(shape.kh, "kh")?, dim(shape.kw, "kw")?],
        ),
        (Operand::Y, [n, k, dim(oh, "oh")?, dim(ow, "ow")?]),
    ];
    // Every stride is a product of dims: each tensor's element count (and that of one image,
    // for n = 0) must fit cuDNN's int64.
    for (operand, [d0, d1, d2, d3]) in dims {
        let image = d1.checked_mul(d2).and_then(|v| v.checked_mul(d3));
        if image.and_then(|v| v.checked_mul(d0)).is_none() {
            return Err(Error::invalid(
                operand.name(),
                "its element count does not fit cuDNN's int64",
            ));
        }
    }
    Ok(dims.map(|(operand, dims)| TensorSpec {
        operand,
        uid: operand.uid(),
        dims,
        strides: packed_strides(shape.format, dims),
        dtype,
        alignment: i64::from(alignment),
        is_virtual: false,
        by_value: false,
    }))
}

/// The alignment class of device pointers: the largest power of two up to [`MAX_ALIGNMENT`]
/// that divides every address (a null pointer divides by anything).
pub fn alignment_of(ptrs: &[u64]) -> u8 {
    let mut a = u64::from(MAX_ALIGNMENT);
    for &p in ptrs {
        if p != 0 {
            a = a.min(1u64 << p.trailing_zeros().min(63));
        }
    }
    a as u8
}

/// Convolution parameters as cuDNN's int64 arrays: `(pre_padding, post_padding, strides,
/// dilations)`, each `[vertical, horizontal]`. Padding is symmetric in nnfuse.
pub fn conv_params(shape: &ConvShape) -> Result<[[i64; 2]; 4]> {
    let pad = [dim(shape.pad.0, "pad")?, dim(shape.pad.1, "pad")?];
    Ok([
        pad,
        pad,
        [
            dim(shape.stride.0, "stride")?,
            dim(shape.stride.1, "stride")?,
        ],
        [
            dim(shape.dilation.0, "dilation")?,
            dim(shape.dilation.1, "dilation")?,
        ],
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(format: TensorFormat) -> ConvShape {
        ConvShape {
            n: 2,
            c_in: 3,
            h: 7,
            w: 5,
            c_out: 4,
            kh: 3,
            kw: 3,
            stride: (2, 1),
            pad: (1, 0),
            dilation: (1, 2),
            format,
        }
    }

    /// Offset of logical index `i` under `strides`.
    fn at(strides: [i64; 4], i: [i64; 4]) -> i64 {
        (0..4).map(|d| strides[d] * i[d]).sum()
    }

    #[test]
    fn strides_match_the_reference_layouts() {
        let dims = [2, 3, 4, 5];
        assert_eq!(packed_strides(TensorFormat::Nchw, dims), [60, 20, 5, 1]);
        assert_eq!(packed_strides(TensorFormat::Nhwc, dims), [60, 1, 15, 3]);
        // Every logical index lands where the f64 reference stores it, and the map is onto.
        for format in [TensorFormat::Nchw, TensorFormat::Nhwc] {
            let s = packed_strides(format, dims);
            let mut seen = [false; 120];
            for b in 0..2 {
                for c in 0..3 {
                    for y in 0..4 {
                        for x in 0..5 {
                            let want = match format {
                                TensorFormat::Nchw => ((b * 3 + c) * 4 + y) * 5 + x,
                                TensorFormat::Nhwc => ((b * 4 + y) * 5 + x) * 3 + c,
                            };
                            let got = at(s, [b, c, y, x]);
                            assert_eq!(got, want, "{format:?} {b} {c} {y} {x}");
                            seen[got as usize] = true;
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&v| v));
        }
    }

    #[test]
    fn specs_have_logical_dims_and_format_strides() {
        let s = shape(TensorFormat::Nhwc);
        let (oh, ow) = s.out_hw().unwrap();
        let [x, w, y] = tensor_specs(&s, DType::F16, 16).unwrap();
        assert_eq!(x.dims, [2, 3, 7, 5]);
        assert_eq!(w.dims, [4, 3, 3, 3]);
        assert_eq!(y.dims, [2, 4, oh as i64, ow as i64]);
        // KRSC: c fastest, then s, then r, then k.
        assert_eq!(w.strides, [27, 1, 9, 3]);
        assert_eq!(x.strides, [105, 1, 15, 3]);
        assert_eq!([x.uid, w.uid, y.uid], [1, 2, 3]);
        assert!(!x.is_virtual && !x.by_value);
        let [_, w, _] = tensor_specs(&shape(TensorFormat::Nchw), DType::F32, 4).unwrap();
        assert_eq!(w.strides, [27, 9, 3, 1]);
        assert_eq!(w.alignment, 4);
        // The element counts the strides span equal the reference's lengths.
        for spec in tensor_specs(&s, DType::F32, 16).unwrap() {
            let span = (0..4)
                .map(|d| (spec.dims[d] - 1) * spec.strides[d])
                .sum::<i64>()
                + 1;
            let want = match spec.operand {
                Operand::X => s.x_len().unwrap(),
                Operand::W => s.w_len().unwrap(),
                Operand::Y => s.y_len().unwrap(),
            };
            assert_eq!(span as usize, want, "{:?}", spec.operand);
        }
    }

    #[test]
    fn bad_shapes_and_alignments_are_named() {
        let mut s = shape(TensorFormat::Nchw);
        s.c_in = 0;
        assert_eq!(
            tensor_specs(&s, DType::F32, 16).unwrap_err().argument(),
            Some("c_in")
        );
        let s = shape(TensorFormat::Nchw);
        for a in [0, 3, 32] {
            assert_eq!(
                tensor_specs(&s, DType::F32, a).unwrap_err().argument(),
                Some("alignment")
            );
        }
    }

    #[test]
    fn alignment_class_is_the_common_power_of_two() {
        assert_eq!(alignment_of(&[0x1000, 0x2000, 0x3000]), 16);
        assert_eq!(alignment_of(&[0x1000, 0x1008]), 8);
        assert_eq!(alignment_of(&[0x1002, 0x1000]), 2);
        assert_eq!(alignment_of(&[0x1001]), 1);
        assert_eq!(alignment_of(&[0]), 16);
        assert_eq!(alignment_of(&[]), 16);
    }

    #[test]
    fn conv_params_are_symmetric_padding() {
        let p = conv_params(&shape(TensorFormat::Nchw)).unwrap();
        assert_eq!(p, [[1, 0], [1, 0], [2, 1], [1, 2]]);
    }
}
