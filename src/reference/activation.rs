//! ReLU and Add+ReLU with a bitmask of the positive elements, and their backward.
//!
//! **Mask layout** (one for every kernel, data type and this reference): `u32` words; bit `i` of
//! word `w` is element `32*w + i`; `ceil(n/32)` words; bits past `n` are zero.
//!
//! **NaN** (as PyTorch): the forward propagates NaN (`relu(NaN) = NaN`), and its mask bit is 0
//! (`NaN > 0` is false), so the backward gives it a zero gradient.
//!
//! Buffers of the wrong length are an [`Error::InvalidArgument`] naming the argument, as
//! everywhere in the crate.

use crate::error::{Error, Result};

/// Words of mask for `n` elements.
pub const fn mask_words(n: usize) -> usize {
    n.div_ceil(32)
}

/// Bit `i` of a mask; an error naming `mask` when it has no word for bit `i`.
pub fn mask_bit(mask: &[u32], i: usize) -> Result<bool> {
    match mask.get(i / 32) {
        Some(w) => Ok((w >> (i % 32)) & 1 == 1),
        None => Err(Error::invalid(
            "mask",
            format!("has {} words, no bit {i}", mask.len()),
        )),
    }
}

/// Whether bit `i` is set, for an `i` the caller has bounded by the mask's length.
fn bit(mask: &[u32], i: usize) -> bool {
    mask.get(i / 32).is_some_and(|w| (w >> (i % 32)) & 1 == 1)
}

/// `Ok` when `got == want`, else an error naming `arg`.
pub(crate) fn expect_len(arg: &str, got: usize, want: usize, what: &str) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::invalid(
            arg,
            format!("length {got} differs from {what} ({want})"),
        ))
    }
}

/// `Ok` when `mask` holds the bits of `n` elements, else an error naming `mask`.
pub(crate) fn expect_mask(mask: &[u32], n: usize) -> Result<()> {
    if mask.len() >= mask_words(n) {
        Ok(())
    } else {
        Err(Error::invalid(
            "mask",
            format!(
                "has {} words; {n} elements need {}",
                mask.len(),
                mask_words(n)
            ),
        ))
    }
}

fn relu(v: f64) -> f64 {
    if v.is_nan() || v > 0.0 {
        v
    } else {
        0.0
    }
}

fn mask_of(pre: &[f64]) -> Vec<u32> {
    let mut mask = vec![0u32; mask_words(pre.len())];
    for (i, &v) in pre.iter().enumerate() {
        if v > 0.0 {
            mask[i / 32] |= 1 << (i % 32);
        }
    }
    mask
}

/// `y = max(x, 0)` and the mask of `x > 0`.
pub fn relu_mask_fwd(x: &[f64]) -> (Vec<f64>, Vec<u32>) {
    (x.iter().map(|&v| relu(v)).collect(), mask_of(x))
}

/// `y = max(x + z, 0)` and the mask of `x + z > 0`. Errors name `z` when its length differs
/// from `x`'s.
pub fn add_relu_mask_fwd(x: &[f64], z: &[f64]) -> Result<(Vec<f64>, Vec<u32>)> {
    expect_len("z", z.len(), x.len(), "x's length")?;
    let pre: Vec<f64> = x.iter().zip(z).map(|(a, b)| a + b).collect();
    Ok((pre.iter().map(|&v| relu(v)).collect(), mask_of(&pre)))
}

/// `dx = dy` where the mask bit is set, else 0. For Add+ReLU the addend's gradient is the same.
/// Errors name `mask` when it is shorter than `mask_words(dy.len())`.
pub fn relu_mask_bwd(dy: &[f64], mask: &[u32]) -> Result<Vec<f64>> {
    expect_mask(mask, dy.len())?;
    Ok(dy
        .iter()
        .enumerate()
        .map(|(i, &g)| if bit(mask, i) { g } else { 0.0 })
        .collect())
}

/// The y-based backward (`dx = dy where y > 0`), the baseline the mask replaces. Errors name
/// `y` when its length differs from `dy`'s.
pub fn relu_bwd_from_y(dy: &[f64], y: &[f64]) -> Result<Vec<f64>> {
    expect_len("y", y.len(), dy.len(), "dy's length")?;
    Ok(dy
        .iter()
        .zip(y)
        .map(|(&g, &v)| if v > 0.0 { g } else { 0.0 })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed() {
        let (y, m) = relu_mask_fwd(&[1.0, -2.0, 0.0, 3.5, f64::NAN]);
        assert_eq!(&y[..4], &[1.0, 0.0, 0.0, 3.5]);
        assert!(y[4].is_nan());
        assert_eq!(m, vec![0b01001]);
        let (y, m) = add_relu_mask_fwd(&[1.0, -2.0, 0.5], &[-2.0, 3.0, -0.5]).unwrap();
        assert_eq!(y, vec![0.0, 1.0, 0.0]);
        assert_eq!(m, vec![0b010]);
        assert_eq!(
            relu_mask_bwd(&[5.0, 6.0, 7.0], &m).unwrap(),
            vec![0.0, 6.0, 0.0]
        );
    }

    /// These panicked (assert or slice index) or, for `relu_bwd_from_y`, silently truncated.
    #[test]
    fn length_mismatches_are_errors_naming_the_argument() {
        let arg = |e: Error| e.argument().map(str::to_owned);
        assert_eq!(
            arg(add_relu_mask_fwd(&[1.0; 3], &[1.0; 2]).unwrap_err()).as_deref(),
            Some("z")
        );
        assert_eq!(
            arg(relu_mask_bwd(&[1.0; 33], &[0]).unwrap_err()).as_deref(),
            Some("mask")
        );
        assert_eq!(
            arg(relu_bwd_from_y(&[1.0; 3], &[1.0; 4]).unwrap_err()).as_deref(),
            Some("y")
        );
        assert_eq!(
            arg(mask_bit(&[1], 32).unwrap_err()).as_deref(),
            Some("mask")
        );
        assert!(mask_bit(&[1], 0).unwrap());
        // Empty inputs are fine.
        assert_eq!(relu_mask_bwd(&[], &[]).unwrap(), Vec::<f64>::new());
    }

    #[test]
    fn word_boundaries_and_tail_bits() {
        for n in [0, 1, 31, 32, 33, 64, 65] {
            let x: Vec<f64> = (0..n)
                .map(|i| if i % 3 == 0 { 1.0 } else { -1.0 })
                .collect();
            let (_, m) = relu_mask_fwd(&x);
            assert_eq!(m.len(), mask_words(n));
            for (i, xi) in x.iter().enumerate() {
                assert_eq!(mask_bit(&m, i).unwrap(), *xi > 0.0);
            }
            if n % 32 != 0 {
                assert_eq!(m[n / 32] >> (n % 32), 0, "tail bits must be zero (n = {n})");
            }
        }
        assert_eq!(relu_mask_fwd(&[1.0; 32]).1, vec![u32::MAX]);
    }

    #[test]
    fn mask_backward_equals_y_backward() {
        let x: Vec<f64> = (0..100).map(|i| ((i * 37) % 11) as f64 - 5.0).collect();
        let dy: Vec<f64> = (0..100).map(|i| i as f64 * 0.5 + 1.0).collect();
        let (y, m) = relu_mask_fwd(&x);
        assert_eq!(
            relu_mask_bwd(&dy, &m).unwrap(),
            relu_bwd_from_y(&dy, &y).unwrap()
        );
    }
}
