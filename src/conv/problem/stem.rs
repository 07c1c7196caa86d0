//! The sizes of nnfuse's tensor-core kernels for layers with few input channels
//! (`kernels/conv_stem.cu`): the filter gradient (the `stem_filter` path) and the forward
//! (`stem_forward`) — which problems they take, how their work splits over blocks, their shared
//! memory and the filter gradient's scratch of partial sums. Shared by the plans' rules and the
//! launchers (`src/conv/stem.rs`), so that a plan never calls eligible what its launcher refuses.
//! Pure: no GPU calls.

use super::shape::{extents_refusal, ConvShape};
use crate::dtype::DType;
use crate::layout::TensorFormat;

/// Output pixels per work unit (`SW_PX` in the kernel): one row segment.
pub(crate) const PX: usize = 128;
/// Filters per block (`SW_KT`).
pub(crate) const KT: usize = 64;
/// Row stride of a unit's staged dy in halves (`SW_LDD`).
const LDD: usize = 72;
/// Columns of the filter gradient (`kh * kw * c_in`) a block holds at most: 4 column warps of
/// 5 tiles of 8 (`NT` ≤ 5 in the kernel).
pub(crate) const MAX_COLUMNS: usize = 160;
/// Input channels at most: the kernel reads each column value with its own 16-bit load, which
/// suits a stem's few channels; wider layers are GEMMs that cuDNN's kernels feed better.
pub(crate) const MAX_CHANNELS: usize = 16;
/// Shared memory of a block at most (two stages), so that two blocks share an H100 SM.
const MAX_SMEM: usize = 113 * 1024;
/// Blocks the work is split into at least (two per SM of a 132-SM H100).
const TARGET_BLOCKS: usize = 264;

/// How the kernel's work is laid out for one problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StemGrid {
    /// Row segments per output row: `ceil(ow / PX)`.
    pub segs: usize,
    /// Work units: `n * oh * segs`.
    pub units: usize,
    /// Unit ranges (`gridDim.x`); the filter gradient's each with its own partial sums.
    pub splits: usize,
    /// Filter tiles (`gridDim.y`).
    pub k_tiles: usize,
    /// Columns of the filter gradient: `kh * kw * c_in`.
    pub columns: usize,
    /// Column tiles of 8 per column warp (the kernel's `NT`, 1 to 5).
    pub nt: usize,
    /// A staged input row's stride in halves (a multiple of 8).
    pub xsw: usize,
    /// 4-byte pieces of a staged input row.
    pub pieces: usize,
    /// Dynamic shared memory of a block.
    pub smem_bytes: usize,
    /// The forward's staged filter row stride in halves (`16 * ceil(columns / 16) + 8`; 0 for
    /// the filter gradient).
    pub ldw: usize,
}

impl StemGrid {
    /// Bytes of the partial sums (f32): one filter gradient per split.
    pub fn scratch_bytes(&self, s: &ConvShape) -> usize {
        self.splits * s.c_out * self.columns * std::mem::size_of::<f32>()
    }
}

/// The staged input row of one unit: its 4-byte pieces and stride. A unit's `PX` pixels at
/// stride `sw` read `((PX - 1) * sw + kw) * c_in` elements of a row, starting at an element
/// that may be odd (one more element, loaded from the even one before it).
/// Saturating: a refused problem's sizes may not fit `usize`.
fn staged_row(s: &ConvShape) -> (usize, usize) {
    let elems = ((PX - 1).saturating_mul(s.stride.1).saturating_add(s.kw)).saturating_mul(s.c_in);
    let pieces = elems.saturating_add(2) / 2;
    (
        pieces,
        2usize.saturating_mul(pieces).saturating_add(7) / 8 * 8,
    )
}

/// Dynamic shared memory of a block for `s`: two stages of dy's `PX` rows and the `kh` input
/// rows.
fn smem_bytes(s: &ConvShape) -> usize {
    let (_, xsw) = staged_row(s);
    (PX * LDD)
        .saturating_add(s.kh.saturating_mul(xsw))
        .saturating_mul(4)
}

/// The kernel's column tiles of 8 per column warp for `s` (`NT`: 4 warps, `ceil(columns / 32)`):
/// which compiled kernel runs it.
pub(crate) fn column_tiles(s: &ConvShape) -> usize {
    columns(s).div_ceil(32).max(1)
}

/// `kh * kw * c_in`, saturating.
fn columns(s: &ConvShape) -> usize {
    s.kh.saturating_mul(s.kw).saturating_mul(s.c_in)
}

/// The grid of `s` with output extent `out_hw`: enough unit ranges that the blocks reach
/// [`TARGET_BLOCKS`], none empty, and no more than the scratch cap `cap` holds.
pub(crate) fn stem_grid(s: &ConvShape, out_hw: (usize, usize), cap: usize) -> StemGrid {
    let segs = out_hw.1.div_ceil(PX);
    let units = s.n * out_hw.0 * segs;
    let k_tiles = s.c_out.div_ceil(KT);
    let columns = s.kh * s.kw * s.c_in;
    let per_split = (s.c_out * columns * std::mem::size_of::<f32>()).max(1);
    let wanted = TARGET_BLOCKS.div_ceil(k_tiles);
    let splits = wanted.min(units).min(cap / per_split).max(1);
    let (pieces, xsw) = staged_row(s);
    StemGrid {
        segs,
        units,
        splits,
        k_tiles,
        columns,
        nt: column_tiles(s),
        xsw,
        pieces,
        smem_bytes: smem_bytes(s),
        ldw: 0,
    }
}

/// The forward's staged filter row stride in halves: the columns in steps of 16, + 8 (the 8 rows
/// an ldmatrix reads fall in 8 bank quads).
fn forward_ldw(s: &ConvShape) -> usize {
    columns(s).div_ceil(16).saturating_mul(16).saturating_add(8)
}

/// Dynamic shared memory of a forward block for `s`: the 64-filter tile, the output tile, the
/// column table (one u32 per column in steps of 16) and two units' input rows.
fn forward_smem_bytes(s: &ConvShape) -> usize {
    let (_, xsw) = staged_row(s);
    let ldw = forward_ldw(s);
    [
        KT.saturating_mul(ldw).saturating_mul(2),
        PX * LDD * 2,
        (ldw - 8).saturating_mul(4),
        s.kh.saturating_mul(xsw).saturating_mul(4),
    ]
    .into_iter()
    .fold(0usize, usize::saturating_add)
}

/// The forward's grid of `s` with output extent `out_hw`: enough unit ranges that the blocks
/// reach [`TARGET_BLOCKS`], none empty (no scratch).
pub(crate) fn stem_forward_grid(s: &ConvShape, out_hw: (usize, usize)) -> StemGrid {
    let g = stem_grid(s, out_hw, usize::MAX);
    StemGrid {
        smem_bytes: forward_smem_bytes(s),
        ldw: forward_ldw(s),
        ..g
    }
}

/// Why the kernel cannot compute the filter gradient of `s` (output extent `out_hw`) in
/// `dtype` with a scratch cap of `cap` bytes, or `None` when it can: f16 or bf16 channels-last,
/// dilation 1, at most [`MAX_CHANNELS`] input channels and [`MAX_COLUMNS`] columns (`kh * kw * c_in`: few input channels), filters
/// in multiples of 8 (dy's 16-byte pieces), input rows of an even element count (x's 4-byte
/// pieces), two stages within [`MAX_SMEM`], extents within 32-bit indices, and one split's
/// partial sums within the cap.
pub(crate) fn stem_filter_refusal(
    s: &ConvShape,
    dtype: DType,
    out_hw: (usize, usize),
    cap: usize,
) -> Option<String> {
    if let Some(why) = shape_refusal(s, dtype, out_hw, smem_bytes) {
        return Some(why);
    }
    let one = s.c_out.saturating_mul(columns(s)).saturating_mul(4);
    if one > cap {
        return Some(format!(
            "one split's partial sums ({one} bytes) exceed the workspace cap of {cap} bytes \
             (NNFUSE_CONV_WORKSPACE_MB / Config::conv_workspace_mb)"
        ));
    }
    None
}

/// Why the forward kernel cannot compute `s` (output extent `out_hw`) in `dtype`, or `None`
/// when it can: as [`stem_filter_refusal`] without the scratch (y is written in pieces of 8
/// filters, as the filter gradient reads dy).
pub(crate) fn stem_forward_refusal(
    s: &ConvShape,
    dtype: DType,
    out_hw: (usize, usize),
) -> Option<String> {
    shape_refusal(s, dtype, out_hw, forward_smem_bytes)
}

/// The refusals both kernels share, `smem` giving the kernel's shared memory for `s` (asked
/// once the channels and columns are known to be few).
fn shape_refusal(
    s: &ConvShape,
    dtype: DType,
    out_hw: (usize, usize),
    smem: fn(&ConvShape) -> usize,
) -> Option<String> {
    if dtype == DType::F32 {
        return Some(
            "f16 and bf16 only: tensor cores read 16-bit operands (f32 data would be rounded)"
                .into(),
        );
    }
    if s.format != TensorFormat::Nhwc {
        return Some("channels-last (NHWC) only: a pixel's channels are one staged row".into());
    }
    if s.dilation != (1, 1) {
        return Some(format!(
            "dilation {:?}: the kernel takes dilation 1",
            s.dilation
        ));
    }
    if s.c_in > MAX_CHANNELS {
        return Some(format!(
            "c_in = {}: the kernel is for few input channels (at most {MAX_CHANNELS}), whose \
             column values it reads one by one",
            s.c_in
        ));
    }
    let columns = columns(s);
    if columns > MAX_COLUMNS {
        return Some(format!(
            "kh*kw*c_in = {columns} columns: a block holds at most {MAX_COLUMNS} (layers with \
             few input channels, such as a 7x7 stem over 3 channels)"
        ));
    }
    if s.c_out % 8 != 0 {
        return Some(format!(
            "c_out = {}: the kernels move dy and y 8 channels (16 bytes) at a time",
            s.c_out
        ));
    }
    if (s.w * s.c_in) % 2 != 0 {
        return Some(format!(
            "w*c_in = {} elements per input row: the kernel copies x in pairs of elements",
            s.w * s.c_in
        ));
    }
    let smem = smem(s);
    if smem > MAX_SMEM {
        return Some(format!(
            "it needs {smem} bytes of shared memory (at most {MAX_SMEM}): stride \
             {} over {} channels is too wide a row",
            s.stride.1, s.c_in
        ));
    }
    let units =
        s.n.checked_mul(out_hw.0)
            .and_then(|v| v.checked_mul(out_hw.1.div_ceil(PX)));
    extents_refusal(
        "the kernel",
        &[
            ("n", s.n),
            ("c_out", s.c_out),
            ("h", s.h),
            ("w*c_in", s.w * s.c_in),
            (
                "oh*stride.0 + kh",
                (out_hw.0 * s.stride.0).saturating_add(s.kh),
            ),
            (
                "(ow + PX)*stride.1*c_in",
                (out_hw.1 + PX).saturating_mul(s.stride.1 * s.c_in),
            ),
            ("n*oh*segments", units.unwrap_or(usize::MAX)),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ResNet-50's stem: 7x7/2 over 3 channels, 224x224 → 64, padding 3.
    fn stem(n: usize) -> ConvShape {
        ConvShape {
            stride: (2, 2),
            ..ConvShape::square(n, 3, 224, 64, 7, TensorFormat::Nhwc)
        }
    }

    #[test]
    fn the_resnet_stem_takes_one_segment_per_row_and_five_column_tiles() {
        let s = stem(32);
        let g = stem_grid(&s, (112, 112), 256 << 20);
        assert_eq!((g.segs, g.units, g.k_tiles), (1, 32 * 112, 1));
        assert_eq!((g.columns, g.nt), (147, 5));
        // 127 * 2 + 7 = 261 input columns of 3 channels, one element more for an odd start.
        assert_eq!(g.pieces, 392);
        assert_eq!(g.xsw, 784);
        assert_eq!(g.smem_bytes, 2 * (128 * 72 + 7 * 784) * 2);
        assert!(2 * g.smem_bytes <= 228 * 1024);
        assert_eq!(g.splits, 264);
        assert_eq!(g.scratch_bytes(&s), 264 * 64 * 147 * 4);
        assert_eq!(
            stem_filter_refusal(&s, DType::F16, (112, 112), 256 << 20),
            None
        );
        assert_eq!(
            stem_filter_refusal(&s, DType::BF16, (112, 112), 256 << 20),
            None
        );
    }

    #[test]
    fn the_staged_row_covers_every_column_a_unit_reads() {
        for (sw, kw, c) in [(1, 1, 2), (2, 7, 3), (1, 3, 16), (4, 11, 1), (3, 5, 4)] {
            let mut s = stem(1);
            (s.stride, s.kw, s.c_in) = ((1, sw), kw, c);
            let (pieces, xsw) = staged_row(&s);
            // The kernel's last read: an odd start (shift 1), pixel PX - 1, tap kw - 1, channel
            // c - 1.
            let last = 1 + (PX - 1) * sw * c + kw * c - 1;
            assert!(last < 2 * pieces && 2 * pieces <= xsw && xsw % 8 == 0);
        }
    }

    #[test]
    fn splits_never_exceed_the_units_or_the_cap() {
        let mut s = stem(1);
        (s.h, s.w) = (6, 6);
        let g = stem_grid(&s, (3, 3), 256 << 20);
        assert_eq!((g.units, g.splits), (3, 3));
        let per = 64 * 147 * 4;
        let g = stem_grid(&stem(32), (112, 112), 2 * per - 1);
        assert_eq!(g.splits, 1);
        let mut wide = stem(32);
        wide.c_out = 256;
        let g = stem_grid(&wide, (112, 112), 1 << 30);
        assert_eq!((g.k_tiles, g.splits), (4, 66));
    }

    #[test]
    fn refusals_name_what_the_kernel_does_not_take() {
        let s = stem(2);
        let ok = |s: &ConvShape, d| stem_filter_refusal(s, d, s.out_hw().unwrap(), 1 << 30);
        assert!(ok(&s, DType::F32).unwrap().contains("f16 and bf16 only"));
        let mut nchw = s;
        nchw.format = TensorFormat::Nchw;
        assert!(ok(&nchw, DType::F16).unwrap().contains("channels-last"));
        let mut dilated = s;
        dilated.dilation = (2, 2);
        assert!(ok(&dilated, DType::F16).unwrap().contains("dilation"));
        let mut wide = s;
        wide.c_in = 4;
        assert!(ok(&wide, DType::F16).unwrap().contains("196 columns"));
        let mut odd_k = s;
        odd_k.c_out = 60;
        assert!(ok(&odd_k, DType::F16)
            .unwrap()
            .contains("8 channels (16 bytes) at a time"));
        let mut odd_row = s;
        (odd_row.w, odd_row.c_in) = (223, 3);
        assert!(ok(&odd_row, DType::F16)
            .unwrap()
            .contains("pairs of elements"));
        let mut many = s;
        (many.c_in, many.kh, many.kw) = (64, 1, 1);
        assert!(ok(&many, DType::F16).unwrap().contains("c_in = 64"));
        let mut far = s;
        (far.stride, far.kh, far.kw, far.c_in) = ((1, 16), 3, 3, 16);
        assert!(ok(&far, DType::F16).unwrap().contains("shared memory"));
        assert!(stem_filter_refusal(&s, DType::F16, (112, 112), 100)
            .unwrap()
            .contains("workspace cap"));
        let mut huge = s;
        huge.n = 1 << 31;
        assert!(ok(&huge, DType::F16).unwrap().contains("32-bit"));
    }

    #[test]
    fn sizes_beyond_usize_are_refused_not_overflowed() {
        let big = usize::MAX / 3;
        for (stride, kh, c_in, c_out, w) in [
            ((1, big), 7, 3, 64, 224),
            ((2, 2), big, 3, 64, 224),
            ((2, 2), 7, 3, big / 8 * 8, 224),
            ((2, 2), 1, 2, 64, big),
        ] {
            let s = ConvShape {
                stride,
                kh,
                c_in,
                c_out,
                w,
                ..stem(2)
            };
            let hw = (112, 112);
            assert!(
                stem_filter_refusal(&s, DType::F16, hw, 1 << 30).is_some(),
                "{s:?}"
            );
            assert!(stem_forward_refusal(&s, DType::F16, hw).is_some(), "{s:?}");
        }
    }
}
