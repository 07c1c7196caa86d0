//! Strided batched GEMM, column-major as cuBLAS:
//! `C[b] = alpha * op(A[b]) * op(B[b]) + beta * C[b]` for `b` in `0..batch`, where `op(A)` is
//! `m x k`, `op(B)` is `k x n`, `C` is `m x n`; element `(i, j)` of a column-major matrix with
//! leading dimension `ld` is at `i + j * ld`; matrix `b` starts at `b * stride` (stride 0
//! broadcasts one matrix to every batch).

/// One strided batched GEMM problem.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmProblem {
    /// `op(A) = A^T` (A stored `k x m`).
    pub trans_a: bool,
    /// `op(B) = B^T` (B stored `n x k`).
    pub trans_b: bool,
    /// Rows of `op(A)` and `C`.
    pub m: usize,
    /// Columns of `op(B)` and `C`.
    pub n: usize,
    /// Inner dimension.
    pub k: usize,
    /// Leading dimension of A as stored.
    pub lda: usize,
    /// Leading dimension of B as stored.
    pub ldb: usize,
    /// Leading dimension of C.
    pub ldc: usize,
    /// Elements between consecutive A matrices.
    pub stride_a: usize,
    /// Elements between consecutive B matrices.
    pub stride_b: usize,
    /// Elements between consecutive C matrices.
    pub stride_c: usize,
    /// Number of matrices.
    pub batch: usize,
    /// Scale of the product.
    pub alpha: f64,
    /// Scale of the old C.
    pub beta: f64,
}

impl GemmProblem {
    /// A packed problem: no transposes, tight leading dimensions and strides, alpha 1, beta 0.
    pub fn packed(batch: usize, m: usize, n: usize, k: usize) -> Self {
        GemmProblem {
            trans_a: false,
            trans_b: false,
            m,
            n,
            k,
            lda: m.max(1),
            ldb: k.max(1),
            ldc: m.max(1),
            stride_a: m * k,
            stride_b: k * n,
            stride_c: m * n,
            batch,
            alpha: 1.0,
            beta: 0.0,
        }
    }
}

/// Computes the problem in f64, updating `c` in place.
///
/// # Panics
/// If a buffer is too short for the problem (a reference, not an API).
pub fn gemm_strided_batched(p: &GemmProblem, a: &[f64], b: &[f64], c: &mut [f64]) {
    for bt in 0..p.batch {
        let (oa, ob, oc) = (bt * p.stride_a, bt * p.stride_b, bt * p.stride_c);
        for j in 0..p.n {
            for i in 0..p.m {
                let mut acc = 0.0;
                for l in 0..p.k {
                    let av = if p.trans_a {
                        a[oa + l + i * p.lda]
                    } else {
                        a[oa + i + l * p.lda]
                    };
                    let bv = if p.trans_b {
                        b[ob + j + l * p.ldb]
                    } else {
                        b[ob + l + j * p.ldb]
                    };
                    acc += av * bv;
                }
                let ci = oc + i + j * p.ldc;
                // beta == 0 ignores the old C (which may hold NaN), as cuBLAS does.
                c[ci] = if p.beta == 0.0 {
                    p.alpha * acc
                } else {
                    p.alpha * acc + p.beta * c[ci]
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_by_two_hand_computed() {
        // A = [1 3; 2 4] (column-major [1,2,3,4]), B = [5 7; 6 8].
        let a = [1.0, 2.0, 3.0, 4.0];
        let b = [5.0, 6.0, 7.0, 8.0];
        let mut c = [0.0; 4];
        gemm_strided_batched(&GemmProblem::packed(1, 2, 2, 2), &a, &b, &mut c);
        // A*B = [1*5+3*6, 1*7+3*8; 2*5+4*6, 2*7+4*8] = [23 31; 34 46]
        assert_eq!(c, [23.0, 34.0, 31.0, 46.0]);
        // A^T * B = [1 2; 3 4] * B = [17 23; 39 53]
        let mut p = GemmProblem::packed(1, 2, 2, 2);
        p.trans_a = true;
        gemm_strided_batched(&p, &a, &b, &mut c);
        assert_eq!(c, [17.0, 39.0, 23.0, 53.0]);
        // A * B^T = A * [5 6; 7 8] = [26 30; 38 44]
        let mut p = GemmProblem::packed(1, 2, 2, 2);
        p.trans_b = true;
        gemm_strided_batched(&p, &a, &b, &mut c);
        assert_eq!(c, [26.0, 38.0, 30.0, 44.0]);
    }

    #[test]
    fn alpha_beta_batch_and_broadcast() {
        let a = [2.0]; // one 1x1 matrix, broadcast (stride 0)
        let b = [1.0, 2.0, 3.0];
        let mut c = [10.0, 20.0, 30.0];
        let mut p = GemmProblem::packed(3, 1, 1, 1);
        p.stride_a = 0;
        p.alpha = 0.5;
        p.beta = 2.0;
        gemm_strided_batched(&p, &a, &b, &mut c);
        assert_eq!(c, [21.0, 42.0, 63.0]);
        // beta = 0 overwrites even NaN.
        let mut c = [f64::NAN; 3];
        p.beta = 0.0;
        gemm_strided_batched(&p, &a, &b, &mut c);
        assert_eq!(c, [1.0, 2.0, 3.0]);
    }

    #[test]
    fn padded_leading_dimension() {
        // 2x1 times 1x2 with lda = 3 (row 2 of storage is padding that must not be read).
        let a = [1.0, 2.0, 99.0];
        let b = [3.0, 4.0];
        let mut p = GemmProblem::packed(1, 2, 2, 1);
        p.lda = 3;
        p.ldc = 3;
        let mut c = [0.0, 0.0, -7.0, 0.0, 0.0, -7.0];
        gemm_strided_batched(&p, &a, &b, &mut c);
        assert_eq!(c, [3.0, 6.0, -7.0, 4.0, 8.0, -7.0]);
    }
}
