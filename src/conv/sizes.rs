//! Pure arithmetic of the convolution paths: which shapes each path can run, how large its
//! intermediate tensors are, how the batch is split so that they fit under the workspace cap, and
//! the seed's tensor-core shape rule for Winograd's batched multiply. No GPU; tested on the CPU.

use super::ConvShape;
use crate::error::{Error, Result};
use crate::layout::TensorFormat;

/// `Some(product)` or `None` on overflow.
fn product(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |p, &d| p.checked_mul(d))
}

fn overflow(what: &str) -> Error {
    Error::invalid("shape", format!("{what} overflows usize"))
}

/// A 1x1 convolution with stride 1 and no padding: the input already is the column matrix, so
/// im2col is skipped and the convolution is one GEMM.
pub fn is_pointwise(s: &ConvShape) -> bool {
    s.kh == 1 && s.kw == 1 && s.stride == (1, 1) && s.pad == (0, 0)
}

/// The im2col column matrix of one image: `P = oh*ow` output pixels by `K = c_in*kh*kw` taps
/// (layouts in [`crate::reference::conv`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Im2colDims {
    /// Output pixels per image.
    pub pixels: usize,
    /// Filter taps (`c_in * kh * kw`).
    pub taps: usize,
    /// Elements of one image's column matrix (`pixels * taps`).
    pub per_image: usize,
}

/// The column matrix's dimensions; errors on an invalid shape or an overflow.
pub fn im2col_dims(s: &ConvShape) -> Result<Im2colDims> {
    let (oh, ow) = s.out_hw()?;
    let pixels = product(&[oh, ow]).ok_or_else(|| overflow("oh*ow"))?;
    let taps = product(&[s.c_in, s.kh, s.kw]).ok_or_else(|| overflow("c_in*kh*kw"))?;
    let per_image = product(&[pixels, taps]).ok_or_else(|| overflow("the column matrix"))?;
    Ok(Im2colDims {
        pixels,
        taps,
        per_image,
    })
}

/// Images per chunk so that a chunk's column matrices (`chunk * per_image` elements of
/// `elem` bytes) fit in `cap_bytes`; `None` when one image's columns alone exceed the cap.
/// A pointwise convolution needs no columns: the whole batch is one chunk.
pub fn im2col_chunk(s: &ConvShape, elem: usize, cap_bytes: usize) -> Result<Option<usize>> {
    if is_pointwise(s) {
        return Ok(Some(s.n));
    }
    let d = im2col_dims(s)?;
    let per_image = d
        .per_image
        .checked_mul(elem)
        .ok_or_else(|| overflow("the column matrix's bytes"))?;
    if per_image > cap_bytes {
        return Ok(None);
    }
    Ok(Some((cap_bytes / per_image.max(1)).clamp(1, s.n)))
}

/// `chunks` balanced chunk sizes covering `n` items with at most `max_chunk` each: the sizes
/// differ by at most one, so a chunked path needs at most two distinct GEMM shapes.
pub fn balanced_chunks(n: usize, max_chunk: usize) -> Vec<usize> {
    if n == 0 {
        return Vec::new();
    }
    let max_chunk = max_chunk.max(1);
    let chunks = n.div_ceil(max_chunk);
    let base = n / chunks;
    let extra = n % chunks;
    (0..chunks).map(|i| base + usize::from(i < extra)).collect()
}

/// The Winograd tile size `F(m x m, 3 x 3)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WinogradTile {
    /// `F(2x2, 3x3)`: 4x4 input tiles, 16 transform positions, 2.25x fewer multiplies.
    F2x3,
    /// `F(4x4, 3x3)`: 6x6 input tiles, 36 transform positions, 4x fewer multiplies.
    F4x3,
}

impl WinogradTile {
    /// Both sizes.
    pub const ALL: [WinogradTile; 2] = [WinogradTile::F2x3, WinogradTile::F4x3];

    /// Output tile side `m`.
    pub const fn m(self) -> usize {
        match self {
            WinogradTile::F2x3 => 2,
            WinogradTile::F4x3 => 4,
        }
    }

    /// Input tile side `m + 2` (`alpha`).
    pub const fn alpha(self) -> usize {
        self.m() + 2
    }

    /// Transform positions `alpha^2`: the batch of the batched multiply.
    pub const fn positions(self) -> usize {
        self.alpha() * self.alpha()
    }

    /// `f2x3` or `f4x3`.
    pub const fn name(self) -> &'static str {
        match self {
            WinogradTile::F2x3 => "f2x3",
            WinogradTile::F4x3 => "f4x3",
        }
    }
}

/// Which engine runs Winograd's batched multiply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WinogradEngine {
    /// nnfuse's strided batched GEMM (cuBLAS/cuBLASLt, tensor cores).
    TensorCore,
    /// nnfuse's Direct batched multiply kernel (shared-memory tiles, no tensor cores).
    Direct,
    /// One fused kernel (`kernels/winograd_fused.cu`): input transform, the per-position
    /// products on tensor cores (`mma.sync`) and the output transform, with the transformed
    /// input and the product kept on chip; only the filter transform runs apart. f16 and bf16,
    /// channel counts multiples of 8, sm_80+ ([`fused_eligible`]).
    Fused,
}

impl WinogradEngine {
    /// Every engine, in the order plans list them.
    pub const ALL: [WinogradEngine; 3] = [
        WinogradEngine::TensorCore,
        WinogradEngine::Direct,
        WinogradEngine::Fused,
    ];

    /// `tensor_core`, `direct` or `fused`.
    pub const fn name(self) -> &'static str {
        match self {
            WinogradEngine::TensorCore => "tensor_core",
            WinogradEngine::Direct => "direct",
            WinogradEngine::Fused => "fused",
        }
    }
}

/// Channel counts of the fused engine are multiples of this: its kernel copies input and filter
/// rows in 16-byte pieces (8 elements) that lie wholly inside or outside the channel range.
pub const FUSED_CHANNEL_MULTIPLE: usize = 8;

/// Why the fused Winograd engine cannot run the forward Winograd problem `s` (for the data
/// gradient: its equivalent forward problem) in `dtype`, or `Ok(())`. Its products run on
/// `mma.sync` with 16-bit operands, so f16 and bf16 only (f32 would need TF32, which nnfuse's
/// f32 paths never use); input and output channel counts multiples of
/// [`FUSED_CHANNEL_MULTIPLE`]. The device (sm_80+, enough shared memory) is checked at run time.
pub fn fused_eligible(
    s: &ConvShape,
    dtype: crate::dtype::DType,
) -> std::result::Result<(), String> {
    let mut why = Vec::new();
    if !matches!(dtype, crate::dtype::DType::F16 | crate::dtype::DType::BF16) {
        why.push(format!(
            "the fused engine multiplies on 16-bit tensor cores: f16 and bf16 only, not {dtype}"
        ));
    }
    for (name, c) in [("c_in", s.c_in), ("c_out", s.c_out)] {
        if c % FUSED_CHANNEL_MULTIPLE != 0 {
            why.push(format!(
                "{name} = {c} is not a multiple of {FUSED_CHANNEL_MULTIPLE} (the fused kernel \
                 copies channels in 16-byte pieces)"
            ));
        }
    }
    if why.is_empty() {
        Ok(())
    } else {
        Err(why.join("; "))
    }
}

/// The seed's tensor-core shapes: the batched multiply of (tiles, C_in, C_out) takes tensor
/// cores when each is divisible by the matching entry of one of these triples.
pub const TENSOR_CORE_SHAPES: [(usize, usize, usize); 3] = [(16, 16, 16), (8, 16, 32), (32, 16, 8)];

/// The seed's rule: the first triple of [`TENSOR_CORE_SHAPES`] that divides
/// `(tiles, c_in, c_out)`, or `None` (then the seed runs the Direct batched multiply).
pub fn tensor_core_rule(tiles: usize, c_in: usize, c_out: usize) -> Option<(usize, usize, usize)> {
    TENSOR_CORE_SHAPES
        .iter()
        .copied()
        .find(|&(a, b, c)| tiles % a == 0 && c_in % b == 0 && c_out % c == 0)
}

/// Why a shape cannot take the Winograd forward path, or `Ok(())`.
pub fn winograd_forward_eligible(s: &ConvShape) -> std::result::Result<(), String> {
    let mut why = Vec::new();
    if s.format != TensorFormat::Nhwc {
        why.push("the format is NCHW (nnfuse's Winograd is NHWC)".to_string());
    }
    if (s.kh, s.kw) != (3, 3) {
        why.push(format!("the filter is {}x{}, not 3x3", s.kh, s.kw));
    }
    if s.stride != (1, 1) {
        why.push(format!("the stride is {:?}, not (1, 1)", s.stride));
    }
    if s.dilation != (1, 1) {
        why.push(format!("the dilation is {:?}, not (1, 1)", s.dilation));
    }
    if why.is_empty() {
        Ok(())
    } else {
        Err(why.join("; "))
    }
}

/// Why a shape cannot take the Winograd data gradient (a forward 3x3 convolution of dy with the
/// filter rotated by 180 degrees and its channel axes swapped, padded by `2 - pad`), or `Ok(())`.
pub fn winograd_backward_data_eligible(s: &ConvShape) -> std::result::Result<(), String> {
    winograd_forward_eligible(s)?;
    if s.pad.0 > 2 || s.pad.1 > 2 {
        return Err(format!(
            "the padding {:?} exceeds 2: the data gradient would need negative padding",
            s.pad
        ));
    }
    Ok(())
}

/// Sizes of one Winograd problem per image (element counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WinogradDims {
    /// Output tiles along the height (`ceil(oh / m)`).
    pub tiles_h: usize,
    /// Output tiles along the width (`ceil(ow / m)`).
    pub tiles_w: usize,
    /// Tiles of one image.
    pub tiles_per_image: usize,
    /// Transform positions (`alpha^2`).
    pub positions: usize,
    /// Transformed input of one image (`positions * tiles_per_image * c_in`).
    pub u_per_image: usize,
    /// Product of one image (`positions * tiles_per_image * c_out`).
    pub m_per_image: usize,
    /// Transformed filter (`positions * c_in * c_out`), once per problem.
    pub v: usize,
}

/// The Winograd sizes of `s` with `tile` (the shape need not be eligible; only its output size
/// and channels matter).
pub fn winograd_dims(s: &ConvShape, tile: WinogradTile) -> Result<WinogradDims> {
    let (oh, ow) = s.out_hw()?;
    let m = tile.m();
    let (tiles_h, tiles_w) = (oh.div_ceil(m), ow.div_ceil(m));
    let tiles_per_image = product(&[tiles_h, tiles_w]).ok_or_else(|| overflow("tiles"))?;
    let positions = tile.positions();
    let u_per_image = product(&[positions, tiles_per_image, s.c_in])
        .ok_or_else(|| overflow("the transformed input"))?;
    let m_per_image = product(&[positions, tiles_per_image, s.c_out])
        .ok_or_else(|| overflow("the Winograd product"))?;
    let v =
        product(&[positions, s.c_in, s.c_out]).ok_or_else(|| overflow("the transformed filter"))?;
    Ok(WinogradDims {
        tiles_h,
        tiles_w,
        tiles_per_image,
        positions,
        u_per_image,
        m_per_image,
        v,
    })
}

/// Images per Winograd chunk so that the transformed filter plus a chunk's transformed input and
/// product (`elem` bytes each) fit in `cap_bytes`; `None` when one image does not fit.
pub fn winograd_chunk(
    s: &ConvShape,
    tile: WinogradTile,
    elem: usize,
    cap_bytes: usize,
) -> Result<Option<usize>> {
    let d = winograd_dims(s, tile)?;
    let bytes = |e: usize| {
        e.checked_mul(elem)
            .ok_or_else(|| overflow("Winograd's bytes"))
    };
    let fixed = bytes(d.v)?;
    let per_image = bytes(
        d.u_per_image
            .checked_add(d.m_per_image)
            .ok_or_else(|| overflow("Winograd's bytes"))?,
    )?;
    if fixed.saturating_add(per_image) > cap_bytes {
        return Ok(None);
    }
    Ok(Some(((cap_bytes - fixed) / per_image.max(1)).clamp(1, s.n)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n: usize, c: usize, h: usize, k: usize, r: usize) -> ConvShape {
        ConvShape {
            n,
            c_in: c,
            h,
            w: h,
            c_out: k,
            kh: r,
            kw: r,
            stride: (1, 1),
            pad: (r / 2, r / 2),
            dilation: (1, 1),
            format: TensorFormat::Nhwc,
        }
    }

    #[test]
    fn tensor_core_rule_matches_the_seed() {
        assert_eq!(tensor_core_rule(16, 16, 16), Some((16, 16, 16)));
        assert_eq!(tensor_core_rule(8, 16, 32), Some((8, 16, 32)));
        assert_eq!(tensor_core_rule(32, 16, 8), Some((32, 16, 8)));
        assert_eq!(tensor_core_rule(8, 16, 16), None, "8 tiles need c_out % 32");
        assert_eq!(tensor_core_rule(40, 48, 64), Some((8, 16, 32)));
        assert_eq!(tensor_core_rule(64, 3, 64), None, "c_in 3");
        assert_eq!(tensor_core_rule(16, 16, 8), None);
        assert_eq!(tensor_core_rule(96, 16, 8), Some((32, 16, 8)));
        // Every (t, c, k) up to 64: the rule is exactly "one triple divides".
        for t in 1..=64 {
            for c in 1..=64 {
                for k in [1, 8, 16, 24, 32, 64] {
                    let want = (t % 16 == 0 && c % 16 == 0 && k % 16 == 0)
                        || (t % 8 == 0 && c % 16 == 0 && k % 32 == 0)
                        || (t % 32 == 0 && c % 16 == 0 && k % 8 == 0);
                    assert_eq!(tensor_core_rule(t, c, k).is_some(), want, "{t} {c} {k}");
                }
            }
        }
    }

    #[test]
    fn fused_eligibility_names_type_and_channels() {
        use crate::dtype::DType;
        let s = shape(2, 64, 14, 24, 3);
        assert!(fused_eligible(&s, DType::F16).is_ok());
        assert!(fused_eligible(&s, DType::BF16).is_ok());
        assert!(fused_eligible(&s, DType::F32)
            .unwrap_err()
            .contains("f16 and bf16"));
        let why = fused_eligible(&shape(1, 30, 7, 12, 3), DType::F16).unwrap_err();
        assert!(
            why.contains("c_in = 30") && why.contains("c_out = 12"),
            "{why}"
        );
        assert!(fused_eligible(&shape(1, 8, 1, 8, 3), DType::F16).is_ok());
        assert_eq!(WinogradEngine::ALL.len(), 3);
        assert_eq!(WinogradEngine::Fused.name(), "fused");
    }

    #[test]
    fn winograd_dims_of_resnet_layers() {
        // 64->64 at 56x56, batch 32: F(4x4) has 14x14 tiles per image.
        let s = shape(32, 64, 56, 64, 3);
        let d = winograd_dims(&s, WinogradTile::F4x3).unwrap();
        assert_eq!((d.tiles_h, d.tiles_w, d.tiles_per_image), (14, 14, 196));
        assert_eq!(d.positions, 36);
        assert_eq!(d.u_per_image, 36 * 196 * 64);
        assert_eq!(d.v, 36 * 64 * 64);
        // 7x7 output: ceil(7/4) = 2, ceil(7/2) = 4 tiles per side.
        let s = shape(32, 512, 7, 512, 3);
        assert_eq!(
            winograd_dims(&s, WinogradTile::F4x3)
                .unwrap()
                .tiles_per_image,
            4
        );
        assert_eq!(
            winograd_dims(&s, WinogradTile::F2x3)
                .unwrap()
                .tiles_per_image,
            16
        );
        assert_eq!(WinogradTile::F2x3.positions(), 16);
    }

    #[test]
    fn winograd_eligibility_names_every_reason() {
        assert!(winograd_forward_eligible(&shape(1, 3, 5, 8, 3)).is_ok());
        let mut s = shape(1, 3, 5, 8, 3);
        s.format = TensorFormat::Nchw;
        s.stride = (2, 1);
        s.dilation = (1, 2);
        let why = winograd_forward_eligible(&s).unwrap_err();
        assert!(why.contains("NCHW") && why.contains("stride") && why.contains("dilation"));
        assert!(winograd_forward_eligible(&shape(1, 3, 5, 8, 5))
            .unwrap_err()
            .contains("5x5"));
        let mut s = shape(1, 3, 9, 8, 3);
        s.pad = (3, 1);
        assert!(winograd_forward_eligible(&s).is_ok());
        assert!(winograd_backward_data_eligible(&s)
            .unwrap_err()
            .contains("padding"));
        s.pad = (2, 0);
        assert!(winograd_backward_data_eligible(&s).is_ok());
    }

    #[test]
    fn chunks_fit_the_cap() {
        let s = shape(256, 64, 56, 64, 3);
        let d = im2col_dims(&s).unwrap();
        assert_eq!((d.pixels, d.taps), (56 * 56, 576));
        let per = d.per_image * 2;
        let chunk = im2col_chunk(&s, 2, 256 << 20).unwrap().unwrap();
        assert!(chunk * per <= 256 << 20 && (chunk + 1) * per > 256 << 20);
        assert_eq!(im2col_chunk(&s, 2, per - 1).unwrap(), None);
        assert_eq!(im2col_chunk(&s, 2, usize::MAX).unwrap(), Some(256));
        let mut p = shape(64, 256, 56, 64, 1);
        p.pad = (0, 0);
        assert!(is_pointwise(&p));
        assert_eq!(im2col_chunk(&p, 2, 1).unwrap(), Some(64));
        let w = winograd_chunk(&s, WinogradTile::F4x3, 2, 64 << 20)
            .unwrap()
            .unwrap();
        let wd = winograd_dims(&s, WinogradTile::F4x3).unwrap();
        assert!(2 * (wd.v + w * (wd.u_per_image + wd.m_per_image)) <= 64 << 20);
        assert_eq!(
            winograd_chunk(&s, WinogradTile::F4x3, 2, 1000).unwrap(),
            None
        );
    }

    #[test]
    fn balanced_chunks_cover_and_differ_by_one() {
        assert!(balanced_chunks(0, 4).is_empty());
        assert_eq!(balanced_chunks(10, 4), vec![4, 3, 3]);
        assert_eq!(balanced_chunks(8, 4), vec![4, 4]);
        assert_eq!(balanced_chunks(3, 100), vec![3]);
        assert_eq!(balanced_chunks(5, 0), vec![1, 1, 1, 1, 1]);
        for n in 1..60 {
            for m in 1..20 {
                let c = balanced_chunks(n, m);
                assert_eq!(c.iter().sum::<usize>(), n);
                assert!(c.iter().all(|&x| x >= 1 && x <= m));
                assert!(c.iter().max().unwrap() - c.iter().min().unwrap() <= 1);
            }
        }
    }

    #[test]
    fn overflow_is_an_error_not_a_wrap() {
        let mut s = shape(1, usize::MAX / 2, 5, 3, 3);
        s.c_in = usize::MAX / 4;
        assert!(im2col_dims(&s).is_err());
        assert!(winograd_dims(&s, WinogradTile::F4x3).is_err());
    }
}
