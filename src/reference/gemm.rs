//! Strided batched GEMM, column-major as cuBLAS:
//! `C[b] = alpha * op(A[b]) * op(B[b]) + beta * C[b]` for `b` in `0..batch`, where `op(A)` is
//! `m x k`, `op(B)` is `k x n`, `C` is `m x n`; element `(i, j)` of a column-major matrix with
//! leading dimension `ld` is at `i + j * ld`; matrix `b` starts at `b * stride` (stride 0
//! broadcasts one matrix to every batch).

use crate::error::{Error, Result};

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

/// Elements a buffer needs so that element `r + col * ld` of matrix `bt * stride` is in it for
/// every `r < rows`, `col < cols`, `bt < batch` (0 when none is touched); `None` on overflow.
fn span(batch: usize, stride: usize, rows: usize, cols: usize, ld: usize) -> Option<usize> {
    if batch == 0 || rows == 0 || cols == 0 {
        return Some(0);
    }
    (batch - 1)
        .checked_mul(stride)?
        .checked_add(rows - 1)?
        .checked_add((cols - 1).checked_mul(ld)?)?
        .checked_add(1)
}

/// `Ok` when `buf` holds `need` elements (`None`: more than memory holds), else an error naming
/// `arg`.
fn expect_span(arg: &str, len: usize, need: Option<usize>) -> Result<()> {
    match need {
        Some(n) if len >= n => Ok(()),
        Some(n) => Err(Error::invalid(
            arg,
            format!("has {len} elements; the problem reaches element {}", n - 1),
        )),
        None => Err(Error::invalid(
            arg,
            "the problem's extent overflows usize (strides or leading dimensions too large)",
        )),
    }
}

/// Computes the problem in f64, updating `c` in place. Errors (as [`Error::InvalidArgument`]
/// naming `a`, `b` or `c`) when a buffer is too short for the problem; nothing is written then.
pub fn gemm_strided_batched(p: &GemmProblem, a: &[f64], b: &[f64], c: &mut [f64]) -> Result<()> {
    // A and B are read only when the product has terms; C is written wherever it has elements.
    let reads = p.m > 0 && p.n > 0 && p.k > 0;
    let (a_rows, a_cols) = if p.trans_a { (p.k, p.m) } else { (p.m, p.k) };
    let (b_rows, b_cols) = if p.trans_b { (p.n, p.k) } else { (p.k, p.n) };
    let read_span = |stride, rows, cols, ld| {
        if reads {
            span(p.batch, stride, rows, cols, ld)
        } else {
            Some(0)
        }
    };
    expect_span("a", a.len(), read_span(p.stride_a, a_rows, a_cols, p.lda))?;
    expect_span("b", b.len(), read_span(p.stride_b, b_rows, b_cols, p.ldb))?;
    expect_span("c", c.len(), span(p.batch, p.stride_c, p.m, p.n, p.ldc))?;
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
    Ok(())
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
        gemm_strided_batched(&GemmProblem::packed(1, 2, 2, 2), &a, &b, &mut c).unwrap();
        // A*B = [1*5+3*6, 1*7+3*8; 2*5+4*6, 2*7+4*8] = [23 31; 34 46]
        assert_eq!(c, [23.0, 34.0, 31.0, 46.0]);
        // A^T * B = [1 2; 3 4] * B = [17 23; 39 53]
        let mut p = GemmProblem::packed(1, 2, 2, 2);
        p.trans_a = true;
        gemm_strided_batched(&p, &a, &b, &mut c).unwrap();
        assert_eq!(c, [17.0, 39.0, 23.0, 53.0]);
        // A * B^T = A * [5 6; 7 8] = [26 30; 38 44]
        let mut p = GemmProblem::packed(1, 2, 2, 2);
        p.trans_b = true;
        gemm_strided_batched(&p, &a, &b, &mut c).unwrap();
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
        gemm_strided_batched(&p, &a, &b, &mut c).unwrap();
        assert_eq!(c, [21.0, 42.0, 63.0]);
        // beta = 0 overwrites even NaN.
        let mut c = [f64::NAN; 3];
        p.beta = 0.0;
        gemm_strided_batched(&p, &a, &b, &mut c).unwrap();
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
        gemm_strided_batched(&p, &a, &b, &mut c).unwrap();
        assert_eq!(c, [3.0, 6.0, -7.0, 4.0, 8.0, -7.0]);
    }

    /// Short buffers once panicked on a slice index; a huge stride wrapped the offsets.
    #[test]
    fn short_buffers_are_errors_naming_them_and_nothing_is_written() {
        let p = GemmProblem::packed(2, 2, 3, 4);
        let (a, b) = (vec![1.0; 16], vec![1.0; 24]);
        let mut c = vec![-1.0; 12];
        gemm_strided_batched(&p, &a, &b, &mut c).unwrap();
        let arg = |e: Error| e.argument().map(str::to_owned);
        let mut c = vec![-1.0; 12];
        let e = gemm_strided_batched(&p, &a[..15], &b, &mut c).unwrap_err();
        assert_eq!(arg(e).as_deref(), Some("a"));
        let e = gemm_strided_batched(&p, &a, &b[..23], &mut c).unwrap_err();
        assert_eq!(arg(e).as_deref(), Some("b"));
        let e = gemm_strided_batched(&p, &a, &b, &mut c[..11]).unwrap_err();
        assert_eq!(arg(e).as_deref(), Some("c"));
        assert_eq!(c, vec![-1.0; 12], "nothing written on an error");
        // Transposed A is stored k x m: the same 16 elements, other leading dimension.
        let mut t = p;
        t.trans_a = true;
        t.lda = 4;
        gemm_strided_batched(&t, &a, &b, &mut c).unwrap();
        t.lda = 5;
        assert!(gemm_strided_batched(&t, &a, &b, &mut c).is_err());
        // Offsets that overflow usize are an error, not a wrapped index.
        let mut huge = p;
        huge.stride_c = usize::MAX;
        let e = gemm_strided_batched(&huge, &a, &b, &mut c).unwrap_err();
        assert_eq!(arg(e).as_deref(), Some("c"));
        // Nothing to compute: empty buffers are fine.
        let empty = GemmProblem::packed(0, 2, 3, 4);
        gemm_strided_batched(&empty, &[], &[], &mut []).unwrap();
        // k = 0 reads neither A nor B but still writes C (alpha * 0).
        let k0 = GemmProblem::packed(1, 2, 2, 0);
        let mut c = vec![5.0; 4];
        gemm_strided_batched(&k0, &[], &[], &mut c).unwrap();
        assert_eq!(c, vec![0.0; 4]);
    }
}
