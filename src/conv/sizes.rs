//! Pure arithmetic of the convolution paths: which shapes each path can run, how large its
//! intermediate tensors are, how the batch is split so that they fit under the workspace cap, and
//! the seed's tensor-core shape rule for Winograd's batched multiply. No GPU; tested on the CPU.

use super::problem::{ConvShape, Direction, WinogradDims};
use crate::error::{Error, Result};

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

/// How many products one output element of direction `d` sums: `c_in*kh*kw` (forward),
/// `c_out*kh*kw` (data gradient; an upper bound under stride or padding), `n*oh*ow` (filter
/// gradient). Saturates; 1 for an invalid shape. A true-f32 sum's rounding error grows with it.
pub fn reduction_len(s: &ConvShape, d: Direction) -> usize {
    let taps = s.kh.saturating_mul(s.kw);
    match d {
        Direction::Forward => s.c_in.saturating_mul(taps),
        Direction::BackwardData => s.c_out.saturating_mul(taps),
        Direction::BackwardFilter => s
            .out_hw()
            .map_or(1, |(oh, ow)| s.n.saturating_mul(oh).saturating_mul(ow)),
    }
    .max(1)
}

/// Least bound of [`true_f32_bound`]: an f32 graph engine config within `1e-5` (relative L2) of
/// a true-f32 reference computes in true f32. True f32 measures ~1e-7 to 1e-6 from f64; TF32
/// ~3e-4; the graph engine config that had no TF32 note 6.6e-4 (docs/CUDNN-GRAPH.md).
pub const TRUE_F32_BOUND_FLOOR: f64 = 1e-5;

/// Largest bound of [`true_f32_bound`]: six times below TF32's ~3e-4, however long the sum.
pub const TRUE_F32_BOUND_CAP: f64 = 5e-5;

/// The relative L2 error against a true-f32 reference above which an f32 graph engine config is
/// not true f32, for outputs that each sum `reduction` products
/// ([`reduction_len`]): `2 * 2^-24 * sqrt(reduction)` within
/// [`TRUE_F32_BOUND_FLOOR`, `TRUE_F32_BOUND_CAP`]. Two correct f32 sums of `L` terms differ by
/// about `0.6 * 2^-24 * sqrt(L)` when each accumulates sequentially (a long filter gradient:
/// `L = n*oh*ow` = 50,176 gives ~8e-6), so the bound leaves 3x for that and stays far below
/// TF32's input rounding (~3e-4, independent of `L`). Pure.
pub fn true_f32_bound(reduction: usize) -> f64 {
    let unit = f64::from(f32::EPSILON) / 2.0;
    (2.0 * unit * (reduction as f64).sqrt()).clamp(TRUE_F32_BOUND_FLOOR, TRUE_F32_BOUND_CAP)
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

/// Images per Winograd chunk (of a batch of `n`) so that the transformed filter plus a chunk's
/// transformed input and product (`elem` bytes each; sizes `d` from the route's geometry) fit in
/// `cap_bytes`; `None` when one image does not fit.
pub fn winograd_chunk(
    d: &WinogradDims,
    n: usize,
    elem: usize,
    cap_bytes: usize,
) -> Result<Option<usize>> {
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
    Ok(Some(((cap_bytes - fixed) / per_image.max(1)).clamp(1, n)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conv::problem::{winograd_dims, WinogradTile};

    use crate::testutil::square_nhwc as shape;

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
        let wd = winograd_dims(&s, WinogradTile::F4x3).unwrap();
        let w = winograd_chunk(&wd, s.n, 2, 64 << 20).unwrap().unwrap();
        assert!(2 * (wd.v + w * (wd.u_per_image + wd.m_per_image)) <= 64 << 20);
        assert_eq!(winograd_chunk(&wd, s.n, 2, 1000).unwrap(), None);
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
