//! ReLU and Add+ReLU with a bitmask of the positive elements, and their backward.
//!
//! **Mask layout** (one for every kernel, data type and this reference): `u32` words; bit `i` of
//! word `w` is element `32*w + i`; `ceil(n/32)` words; bits past `n` are zero.
//!
//! **NaN** (as PyTorch): the forward propagates NaN (`relu(NaN) = NaN`), and its mask bit is 0
//! (`NaN > 0` is false), so the backward gives it a zero gradient.

/// Words of mask for `n` elements.
pub const fn mask_words(n: usize) -> usize {
    n.div_ceil(32)
}

/// Bit `i` of a mask.
pub fn mask_bit(mask: &[u32], i: usize) -> bool {
    (mask[i / 32] >> (i % 32)) & 1 == 1
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

/// `y = max(x + z, 0)` and the mask of `x + z > 0`.
///
/// # Panics
/// If `x` and `z` differ in length (a reference, not an API).
pub fn add_relu_mask_fwd(x: &[f64], z: &[f64]) -> (Vec<f64>, Vec<u32>) {
    assert_eq!(x.len(), z.len(), "x and z lengths differ");
    let pre: Vec<f64> = x.iter().zip(z).map(|(a, b)| a + b).collect();
    (pre.iter().map(|&v| relu(v)).collect(), mask_of(&pre))
}

/// `dx = dy` where the mask bit is set, else 0. For Add+ReLU the addend's gradient is the same.
///
/// # Panics
/// If the mask is shorter than `mask_words(dy.len())`.
pub fn relu_mask_bwd(dy: &[f64], mask: &[u32]) -> Vec<f64> {
    assert!(mask.len() >= mask_words(dy.len()), "mask too short");
    dy.iter()
        .enumerate()
        .map(|(i, &g)| if mask_bit(mask, i) { g } else { 0.0 })
        .collect()
}

/// The y-based backward (`dx = dy where y > 0`), the baseline the mask replaces.
pub fn relu_bwd_from_y(dy: &[f64], y: &[f64]) -> Vec<f64> {
    dy.iter()
        .zip(y)
        .map(|(&g, &v)| if v > 0.0 { g } else { 0.0 })
        .collect()
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
        let (y, m) = add_relu_mask_fwd(&[1.0, -2.0, 0.5], &[-2.0, 3.0, -0.5]);
        assert_eq!(y, vec![0.0, 1.0, 0.0]);
        assert_eq!(m, vec![0b010]);
        assert_eq!(relu_mask_bwd(&[5.0, 6.0, 7.0], &m), vec![0.0, 6.0, 0.0]);
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
                assert_eq!(mask_bit(&m, i), *xi > 0.0);
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
        assert_eq!(relu_mask_bwd(&dy, &m), relu_bwd_from_y(&dy, &y));
    }
}
