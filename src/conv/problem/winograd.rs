//! Winograd's problem geometry: the tile sizes and batched-multiply engines, which shapes
//! Winograd can run, the forward problem it computes for each direction and its sizes. Pure;
//! used by the plan, the launchers and the f64 reference alike.

use super::direction::Direction;
use super::shape::ConvShape;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::TensorFormat;

/// `Some(product)` or `None` on overflow.
fn product(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |p, &d| p.checked_mul(d))
}

fn overflow(what: &str) -> Error {
    Error::invalid("shape", format!("{what} overflows usize"))
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
/// `FUSED_CHANNEL_MULTIPLE`. The device (sm_80+, enough shared memory) is checked at run time.
pub fn fused_eligible(s: &ConvShape, dtype: DType) -> std::result::Result<(), String> {
    let mut why = Vec::new();
    if !matches!(dtype, DType::F16 | DType::BF16) {
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

/// The forward convolution that Winograd computes for `direction`: the problem itself for the
/// forward; for the data gradient, dy convolved with the filter rotated by 180 degrees and its
/// channel axes swapped, padded by `2 - pad` (an input of `oh x ow x c_out`, an output of
/// `h x w x c_in`). Only meaningful for a shape that passes the Winograd eligibility.
pub fn winograd_equivalent(s: &ConvShape, direction: Direction) -> Option<ConvShape> {
    match direction {
        Direction::Forward => Some(*s),
        Direction::BackwardData => {
            let (oh, ow) = s.out_hw().ok()?;
            Some(ConvShape {
                n: s.n,
                c_in: s.c_out,
                h: oh,
                w: ow,
                c_out: s.c_in,
                kh: 3,
                kw: 3,
                stride: (1, 1),
                pad: (2usize.checked_sub(s.pad.0)?, 2usize.checked_sub(s.pad.1)?),
                dilation: (1, 1),
                format: s.format,
            })
        }
        Direction::BackwardFilter => None,
    }
}

/// The Winograd geometry of one (problem, direction, tile): the forward convolution Winograd
/// computes (`winograd_equivalent`) and its sizes ([`winograd_dims`]). Computed once, when a
/// route is planned, and carried to the launchers (nothing recomputes it per call).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WinogradGeometry {
    /// The tile size.
    pub tile: WinogradTile,
    /// The forward convolution Winograd runs (the problem itself for the forward; for the data
    /// gradient dy convolved with the rotated, channel-swapped filter).
    pub problem: ConvShape,
    /// Its sizes per image.
    pub dims: WinogradDims,
}

impl WinogradGeometry {
    /// The geometry of `s` for `direction` with `tile`; `None` when the direction has no
    /// Winograd form (the filter gradient, or a data gradient with padding over 2). Errors on
    /// an invalid shape or an overflowing size.
    pub fn new(
        s: &ConvShape,
        direction: Direction,
        tile: WinogradTile,
    ) -> Result<Option<WinogradGeometry>> {
        let Some(problem) = winograd_equivalent(s, direction) else {
            return Ok(None);
        };
        let dims = winograd_dims(&problem, tile)?;
        Ok(Some(WinogradGeometry {
            tile,
            problem,
            dims,
        }))
    }

    /// The geometry of the forward convolution `s` itself (which always has one).
    pub(crate) fn forward(s: &ConvShape, tile: WinogradTile) -> Result<WinogradGeometry> {
        Ok(WinogradGeometry {
            tile,
            problem: *s,
            dims: winograd_dims(s, tile)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testutil::square_nhwc as shape;

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
    fn backward_data_equivalent_has_input_size_output() {
        let mut s = shape(2, 5, 9, 7, 3);
        for pad in [(0, 0), (1, 1), (2, 0), (0, 2)] {
            s.pad = pad;
            let (oh, ow) = s.out_hw().unwrap();
            let eq = winograd_equivalent(&s, Direction::BackwardData).unwrap();
            assert_eq!((eq.h, eq.w, eq.c_in, eq.c_out), (oh, ow, 7, 5));
            assert_eq!(eq.out_hw().unwrap(), (s.h, s.w), "{pad:?}");
        }
        s.pad = (3, 1);
        assert!(winograd_equivalent(&s, Direction::BackwardData).is_none());
        assert!(winograd_equivalent(&s, Direction::BackwardFilter).is_none());
    }
}
