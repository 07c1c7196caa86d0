//! The sizes of nnfuse's filter-gradient kernel (the `direct_filter` path,
//! `kernels/conv_wgrad.cu`): which problems it takes, how its work splits over blocks and how
//! much scratch its partial sums need. Shared by the plan's rule and the launcher, so that the
//! plan never calls eligible what the launcher refuses. Pure: no GPU calls.

use super::shape::{extents_refusal, ConvShape};
use crate::dtype::DType;
#[cfg(test)]
use crate::layout::TensorFormat;

/// Filters per block (`KT` in the kernel).
pub(crate) const KT: usize = 64;
/// Input channels per block (`CT`).
pub(crate) const CT: usize = 32;
/// Output columns per work unit (`SEG`).
pub(crate) const SEG: usize = 64;
/// Blocks the work is split into at least (two per SM of a 132-SM H100), so that every SM
/// has blocks to interleave while the filter is small.
const TARGET_BLOCKS: usize = 264;

/// How the kernel's work is laid out for one problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FilterGradGrid {
    /// Output row segments per row: `ceil(ow / SEG)`.
    pub segs: usize,
    /// Work units: `n * oh * segs`.
    pub units: usize,
    /// Unit ranges (`gridDim.x`), each with its own partial sums.
    pub splits: usize,
    /// Input-channel tiles (`gridDim.y`).
    pub c_tiles: usize,
    /// Filter tiles (`gridDim.z`).
    pub k_tiles: usize,
}

impl FilterGradGrid {
    /// Bytes of the partial sums (f32): one filter gradient per split.
    pub fn scratch_bytes(&self, s: &ConvShape) -> usize {
        self.splits * s.c_out * s.c_in * 9 * std::mem::size_of::<f32>()
    }
}

/// The grid of `s` with output extent `out_hw`: enough unit ranges that the blocks reach
/// [`TARGET_BLOCKS`], none empty, and no more than the scratch cap `cap` holds.
pub(crate) fn filter_grad_grid(
    s: &ConvShape,
    out_hw: (usize, usize),
    cap: usize,
) -> FilterGradGrid {
    let segs = out_hw.1.div_ceil(SEG);
    let units = s.n * out_hw.0 * segs;
    let c_tiles = s.c_in.div_ceil(CT);
    let k_tiles = s.c_out.div_ceil(KT);
    let per_split = (s.c_out * s.c_in * 9 * std::mem::size_of::<f32>()).max(1);
    let wanted = TARGET_BLOCKS.div_ceil(c_tiles * k_tiles);
    let splits = wanted.min(units).min(cap / per_split).max(1);
    FilterGradGrid {
        segs,
        units,
        splits,
        c_tiles,
        k_tiles,
    }
}

/// Why the filter-gradient kernel cannot compute the filter gradient of `s` (output extent
/// `out_hw`) in `dtype` with a scratch cap of `cap` bytes, or `None` when it can: f32 (for
/// f16 and bf16 cuDNN's tensor-core engines run such layers 10x faster), a 3x3 filter at
/// stride 1 and dilation 1, extents within the kernel's 32-bit indices (per-tensor offsets are
/// 64-bit), and one split's partial sums within the cap.
pub(crate) fn direct_filter_refusal(
    s: &ConvShape,
    dtype: DType,
    out_hw: (usize, usize),
    cap: usize,
) -> Option<String> {
    if dtype != DType::F32 {
        return Some(format!(
            "f32 only: for {dtype} cuDNN's tensor-core filter gradients are far faster than \
             FMA units"
        ));
    }
    if (s.kh, s.kw) != (3, 3) {
        return Some(format!("a {}x{} filter: the kernel takes 3x3", s.kh, s.kw));
    }
    if s.stride != (1, 1) || s.dilation != (1, 1) {
        return Some(format!(
            "stride {:?}, dilation {:?}: the kernel takes stride 1 and dilation 1",
            s.stride, s.dilation
        ));
    }
    let units =
        s.n.checked_mul(out_hw.0)
            .and_then(|v| v.checked_mul(out_hw.1.div_ceil(SEG)));
    if let Some(why) = extents_refusal(
        "the filter-gradient kernel",
        &[
            ("n", s.n),
            ("c_in", s.c_in),
            ("c_out", s.c_out),
            ("h", s.h),
            ("w", s.w),
            ("pad.0", s.pad.0),
            ("pad.1", s.pad.1),
            ("oh + 2", out_hw.0.saturating_add(2)),
            ("ow + SEG", out_hw.1.saturating_add(SEG)),
            ("n*oh*segments", units.unwrap_or(usize::MAX)),
        ],
    ) {
        return Some(why);
    }
    let one = s.c_out * s.c_in * 9 * std::mem::size_of::<f32>();
    if one > cap {
        return Some(format!(
            "one split's partial sums ({one} bytes) exceed the workspace cap of {cap} bytes \
             (NNFUSE_CONV_WORKSPACE_MB / Config::conv_workspace_mb)"
        ));
    }
    None
}

/// dw's element order for `format`: the index of element `(k, c, rs)` of a 3x3 filter with
/// `c_in` channels, KCRS (NCHW) or KRSC (NHWC).
#[cfg(test)]
fn filter_index(format: TensorFormat, c_in: usize, k: usize, c: usize, rs: usize) -> usize {
    match format {
        TensorFormat::Nchw => (k * c_in + c) * 9 + rs,
        TensorFormat::Nhwc => (k * 9 + rs) * c_in + c,
    }
}

/// `conv_wgrad_reduce_f32`'s source index, statement for statement: the KCRS partial-sum index
/// of dw's element `i` (KRSC for NHWC, else KCRS).
#[cfg(test)]
fn reduce_source(nhwc: bool, c_in: usize, i: usize) -> usize {
    if nhwc {
        let (cc, rs, kk) = (i % c_in, (i / c_in) % 9, i / (c_in * 9));
        (kk * c_in + cc) * 9 + rs
    } else {
        i
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n: usize, c: usize, k: usize, hw: usize) -> ConvShape {
        ConvShape {
            n,
            c_in: c,
            h: hw,
            w: hw,
            c_out: k,
            kh: 3,
            kw: 3,
            stride: (1, 1),
            pad: (1, 1),
            dilation: (1, 1),
            format: TensorFormat::Nchw,
        }
    }

    #[test]
    fn the_demo_layer_splits_into_two_blocks_per_sm() {
        let s = shape(32, 64, 64, 56);
        let g = filter_grad_grid(&s, (56, 56), 256 << 20);
        assert_eq!((g.segs, g.units, g.c_tiles, g.k_tiles), (1, 1792, 2, 1));
        assert_eq!(g.splits, 132);
        assert_eq!(g.scratch_bytes(&s), 132 * 64 * 64 * 9 * 4);
    }

    #[test]
    fn splits_never_exceed_the_units_or_the_cap() {
        let s = shape(1, 16, 8, 3);
        let g = filter_grad_grid(&s, (3, 3), 256 << 20);
        assert_eq!(g.units, 3);
        assert_eq!(g.splits, 3);
        let big = shape(32, 512, 512, 7);
        let per = 512 * 512 * 9 * 4;
        // 264 blocks over 16 x 8 = 128 tiles: three splits wanted, when the cap holds them.
        let g = filter_grad_grid(&big, (7, 7), 1 << 30);
        assert_eq!(g.splits, 3);
        let g = filter_grad_grid(&big, (7, 7), 2 * per - 1);
        assert_eq!(g.splits, 1);
        let g = filter_grad_grid(&big, (7, 7), per);
        assert_eq!(g.splits, 1);
    }

    #[test]
    fn wide_rows_take_several_segments() {
        let s = shape(2, 3, 5, 130);
        let g = filter_grad_grid(&s, (130, 130), 1 << 30);
        assert_eq!(g.segs, 3);
        assert_eq!(g.units, 2 * 130 * 3);
    }

    #[test]
    fn refusals_name_what_the_kernel_does_not_take() {
        let s = shape(2, 8, 8, 10);
        assert_eq!(
            direct_filter_refusal(&s, DType::F32, (10, 10), 1 << 20),
            None
        );
        assert!(direct_filter_refusal(&s, DType::F16, (10, 10), 1 << 20)
            .unwrap()
            .contains("f32 only"));
        let mut k5 = s;
        (k5.kh, k5.kw) = (5, 5);
        assert!(direct_filter_refusal(&k5, DType::F32, (8, 8), 1 << 20)
            .unwrap()
            .contains("5x5"));
        let mut strided = s;
        strided.stride = (2, 2);
        assert!(direct_filter_refusal(&strided, DType::F32, (5, 5), 1 << 20)
            .unwrap()
            .contains("stride"));
        let mut dilated = s;
        dilated.dilation = (2, 2);
        assert!(direct_filter_refusal(&dilated, DType::F32, (8, 8), 1 << 20)
            .unwrap()
            .contains("dilation"));
        assert!(direct_filter_refusal(&s, DType::F32, (10, 10), 100)
            .unwrap()
            .contains("workspace cap"));
        let mut huge = s;
        huge.n = 1 << 31;
        assert!(direct_filter_refusal(&huge, DType::F32, (10, 10), 1 << 20)
            .unwrap()
            .contains("32-bit"));
    }

    #[test]
    fn the_reduce_reads_each_elements_partial_sums() {
        let (k_out, c_in) = (5, 7);
        for format in [TensorFormat::Nchw, TensorFormat::Nhwc] {
            let mut seen = vec![false; k_out * c_in * 9];
            for k in 0..k_out {
                for c in 0..c_in {
                    for rs in 0..9 {
                        let i = filter_index(format, c_in, k, c, rs);
                        let src = reduce_source(format == TensorFormat::Nhwc, c_in, i);
                        assert_eq!(src, filter_index(TensorFormat::Nchw, c_in, k, c, rs));
                        assert!(!seen[i], "{format:?}: element {i} written twice");
                        seen[i] = true;
                    }
                }
            }
        }
    }
}
