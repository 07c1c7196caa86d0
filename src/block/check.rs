//! The verdict of a fused route's check against the unfused composition (pure): relative L2
//! difference and non-finite mismatches, against a tolerance per data type.

use crate::dtype::DType;

/// The largest relative L2 difference from the unfused composition a fused route may show:
/// f32 1e-5 (both are f32 throughout; folding only moves roundings), f16/bf16 1e-2 (the folded
/// filter and bias are rounded to the data type once more).
#[doc(hidden)] // reached through `internals`
pub const fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 | DType::BF16 => 1e-2,
    }
}

/// What a check found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Verdict {
    /// `||got - reference|| / ||reference||` over the elements finite in both.
    pub rel_l2: f64,
    /// Elements finite in one and not the other.
    pub nonfinite: usize,
    /// Within the tolerance and no non-finite mismatch.
    pub passed: bool,
}

/// Compares `got` with `reference` (same length) for `dtype`.
pub(crate) fn judge(reference: &[f64], got: &[f64], dtype: DType) -> Verdict {
    let (mut num, mut den, mut nonfinite) = (0.0f64, 0.0f64, 0usize);
    if reference.len() != got.len() {
        nonfinite = reference.len().abs_diff(got.len());
    }
    for (r, g) in reference.iter().zip(got) {
        match (r.is_finite(), g.is_finite()) {
            (true, true) => {
                num += (g - r) * (g - r);
                den += r * r;
            }
            (false, false) => {}
            _ => nonfinite += 1,
        }
    }
    let rel_l2 = if den > 0.0 {
        (num / den).sqrt()
    } else if num == 0.0 {
        0.0
    } else {
        f64::INFINITY
    };
    Verdict {
        rel_l2,
        nonfinite,
        passed: nonfinite == 0 && rel_l2 <= tolerance(dtype),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts() {
        let r = [1.0, -2.0, 3.0, 0.0];
        let v = judge(&r, &r, DType::F32);
        assert!(v.passed && v.rel_l2 == 0.0);
        let g = [1.0, -2.0, 3.0 + 1e-3, 0.0];
        assert!(!judge(&r, &g, DType::F32).passed);
        assert!(judge(&r, &g, DType::F16).passed);
        let g = [1.0, f64::NAN, 3.0, 0.0];
        let v = judge(&r, &g, DType::BF16);
        assert_eq!(v.nonfinite, 1);
        assert!(!v.passed);
        assert!(!judge(&r, &r[..3], DType::F16).passed);
        assert!(judge(&[0.0; 3], &[0.0; 3], DType::F32).passed);
        assert!(!judge(&[0.0; 3], &[0.0, 1.0, 0.0], DType::F32).passed);
    }
}
