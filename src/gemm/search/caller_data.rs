//! The rule for searching on the caller's data (pure): the candidates are checked on the
//! caller's operands only when the cuBLAS default's result there can tell a wrong result from a
//! right one.

use std::fmt;

/// Statistics of the cuBLAS default's result over C's matrix elements (never its gaps),
/// computed on the device before the search trusts the caller's data.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ResultStats {
    /// Elements of C's matrices (`batch * m * n`).
    pub elements: f64,
    /// Sum of squares of the finite elements.
    pub sum_sq: f64,
    /// Non-finite elements (NaN, ±Inf).
    pub non_finite: f64,
    /// Finite, nonzero elements.
    pub nonzero: f64,
    /// Sum of squares of the product's part, `result - beta * old C`, over the finite elements
    /// (equal to `sum_sq` when beta is 0).
    pub product_sq: f64,
}

impl ResultStats {
    /// From the four device sums (`sum_sq, non_finite, nonzero, product_sq`) and the element
    /// count; missing sums read as NaN (unsuitable).
    pub fn from_sums(sums: &[f64], elements: f64) -> ResultStats {
        let at = |i: usize| sums.get(i).copied().unwrap_or(f64::NAN);
        ResultStats {
            elements,
            sum_sq: at(0),
            non_finite: at(1),
            nonzero: at(2),
            product_sq: at(3),
        }
    }
}

/// Least fraction of the default's result that must be nonzero for the caller's data to check
/// candidates: where most of the result is exactly 0 (zeroed buffers, padding), a candidate that
/// computes those elements wrongly, or skips them, could still pass.
pub const MIN_NONZERO_FRACTION: f64 = 0.5;

/// Least share of the result's norm that the product `alpha * op(A) op(B)` must have, when beta
/// is not 0, for the caller's data to check candidates: `||result - beta * C|| >= share *
/// ||result||`. Where `beta * C` dominates, an error in the product would hide under it. (The
/// pseudo-random operands give at least 0.5 too: about 0.5 at k = 1, close to 1 for large k.)
pub const MIN_PRODUCT_SHARE: f64 = 0.5;

/// Why the caller's data could not check the search's candidates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Unsuitable {
    /// The default's result has non-finite elements: NaN or Inf in A, B (or C when beta != 0),
    /// or overflow. NaN compares equal to NaN, so these elements would check nothing.
    NonFinite {
        /// How many.
        count: u64,
    },
    /// Too little of the default's result is nonzero ([`MIN_NONZERO_FRACTION`]).
    MostlyZero {
        /// Nonzero elements.
        nonzero: u64,
        /// All elements.
        elements: u64,
    },
    /// `beta * C` dominates the result ([`MIN_PRODUCT_SHARE`]).
    ProductNegligible {
        /// `||result - beta * C|| / ||result||`.
        share: f64,
    },
}

impl fmt::Display for Unsuitable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unsuitable::NonFinite { count } => write!(
                f,
                "the cuBLAS default's result has {count} non-finite elements (NaN or Inf in the \
                 inputs, or overflow)"
            ),
            Unsuitable::MostlyZero { nonzero, elements } => write!(
                f,
                "only {nonzero} of the {elements} elements of the cuBLAS default's result are \
                 nonzero (fewer than {:.0}%)",
                MIN_NONZERO_FRACTION * 100.0
            ),
            Unsuitable::ProductNegligible { share } => write!(
                f,
                "alpha * op(A) op(B) is only {share:.3} of the result's norm (beta * C \
                 dominates; at least {MIN_PRODUCT_SHARE} needed)"
            ),
        }
    }
}

/// The rule for searching on the caller's data: the candidates are compared with the cuBLAS
/// default on the caller's operands only when the default's result there is finite everywhere,
/// nonzero in at least [`MIN_NONZERO_FRACTION`] of its elements, and, when beta is not 0, made
/// at least [`MIN_PRODUCT_SHARE`] of the product (by norm). Otherwise the search falls back to
/// pseudo-random scratch operands and says why (this returns the reason). NaN statistics (not
/// read back) are unsuitable.
pub fn caller_data_unsuitable(s: &ResultStats) -> Option<Unsuitable> {
    if s.non_finite != 0.0 {
        return Some(Unsuitable::NonFinite {
            count: if s.non_finite.is_finite() {
                s.non_finite as u64
            } else {
                u64::MAX
            },
        });
    }
    let mostly_zero = Unsuitable::MostlyZero {
        nonzero: if s.nonzero.is_finite() {
            s.nonzero as u64
        } else {
            0
        },
        elements: s.elements as u64,
    };
    let too_few = s.nonzero.is_nan() || s.nonzero < MIN_NONZERO_FRACTION * s.elements;
    if too_few || s.sum_sq.is_nan() || s.sum_sq <= 0.0 {
        return Some(mostly_zero);
    }
    let share = (s.product_sq / s.sum_sq).sqrt();
    if share.is_nan() || share < MIN_PRODUCT_SHARE {
        return Some(Unsuitable::ProductNegligible { share });
    }
    None
}
