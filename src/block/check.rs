//! The verdict of a fused route's check against the unfused composition (pure): the relative L2
//! difference and the non-finite elements the on-device comparison found
//! (`src/device_check.rs`), against a tolerance per data type.

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

/// Whether a fused route's output passes its check against the unfused composition, from
/// the on-device comparison's `(relative L2, non-finite elements)`: no non-finite element and
/// the relative L2 difference within [`tolerance`] (a NaN difference fails).
pub(crate) fn passes(rel_l2: f64, nonfinite: f64, dtype: DType) -> bool {
    nonfinite == 0.0 && rel_l2 <= tolerance(dtype)
}

/// The largest relative L2 difference between two routes' gradients through a chain of
/// units (each route checked operation by operation against f64 in the tests): ten times
/// [`tolerance`]. In halves a data gradient through three units is itself 1e-2 to 6e-2 from f64
/// end to end on either route (measured on the H100 over seven seeds, f16 bottleneck at batch
/// 2), so two correct routes differ by up to the sum (dx 4.5e-2 apart at batch 2, the worst
/// gradient 5.3e-2 apart at batch 32); a wrong formula or a broken engine differs by order
/// one. Subtler errors are the tests' to find, against f64 per operation.
pub(crate) fn chain_gradient_bound(dtype: DType) -> f64 {
    10.0 * tolerance(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_check_passes_within_the_tolerance_and_without_non_finite_elements() {
        assert!(passes(0.0, 0.0, DType::F32));
        assert!(passes(9e-6, 0.0, DType::F32));
        assert!(!passes(2e-5, 0.0, DType::F32));
        assert!(passes(2e-5, 0.0, DType::F16));
        assert!(passes(9e-3, 0.0, DType::BF16));
        assert!(!passes(1e-3, 1.0, DType::BF16));
        assert!(!passes(f64::NAN, 0.0, DType::F16));
        assert!(!passes(f64::INFINITY, 0.0, DType::F16));
        assert_eq!(chain_gradient_bound(DType::F16), 1e-1);
        assert_eq!(chain_gradient_bound(DType::F32), 1e-4);
    }
}
