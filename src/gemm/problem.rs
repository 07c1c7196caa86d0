//! The problem description, its validation and the tuning key: pure code, tested on the CPU.
//!
//! Conventions are those of [`crate::reference::gemm`] and cuBLAS: column-major matrices,
//! `C[b] = alpha * op(A[b]) * op(B[b]) + beta * C[b]` for `b` in `0..batch`; `op(A)` is `m x k`,
//! `op(B)` is `k x n`, `C` is `m x n`; element `(i, j)` of a matrix with leading dimension `ld`
//! is at `i + j * ld`; matrix `b` starts at `b * stride` elements.

use std::fmt;
use std::str::FromStr;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reference::gemm::GemmProblem;
use crate::validate::{self, Aliasing, Need, Operand, Role};

/// The precision products are accumulated in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Compute {
    /// `CUBLAS_COMPUTE_32F`: f32 accumulation, alpha and beta in f32. For f32 data this is true
    /// single precision: nnfuse never asks for TF32 (`CUBLAS_COMPUTE_32F_FAST_TF32`) and never
    /// sets the TF32 math mode on its cuBLAS handle, so f32 results match an f64 reference to
    /// about 1e-6 relative.
    #[default]
    F32,
    /// `CUBLAS_COMPUTE_16F`: f16 accumulation, alpha and beta rounded to f16. Only for f16 data;
    /// faster on some GPUs, less accurate (the error grows with `sqrt(k)`, see [`tolerance`]).
    F16,
}

impl Compute {
    /// `f32` or `f16`.
    pub const fn name(self) -> &'static str {
        match self {
            Compute::F32 => "f32",
            Compute::F16 => "f16",
        }
    }
}

impl fmt::Display for Compute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Compute {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "32f" | "float" => Ok(Compute::F32),
            "f16" | "16f" | "half" => Ok(Compute::F16),
            _ => Err(Error::invalid(
                "compute",
                format!("{s:?} is not one of f32, f16"),
            )),
        }
    }
}

/// One strided batched GEMM, column-major as cuBLAS (see the module documentation).
///
/// Dimensions are element counts. `m == 0`, `n == 0` or `batch == 0` make the call a no-op
/// (C is empty; nothing is launched; the other arguments are still checked). `k == 0` with a
/// non-empty C is an error (the result would be `beta * C`, which is not a GEMM: scale C
/// yourself). A stride of 0 for A or B broadcasts one matrix to every batch; a stride of 0 for C
/// with `batch > 1` is an error (every batch would write the same C).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Problem {
    /// `op(A) = A^T` (A stored `k x m`).
    pub trans_a: bool,
    /// `op(B) = B^T` (B stored `n x k`).
    pub trans_b: bool,
    /// Rows of `op(A)` and of C.
    pub m: usize,
    /// Columns of `op(B)` and of C.
    pub n: usize,
    /// Inner dimension.
    pub k: usize,
    /// Leading dimension of A as stored (`>= m`, or `>= k` when `trans_a`).
    pub lda: usize,
    /// Leading dimension of B as stored (`>= k`, or `>= n` when `trans_b`).
    pub ldb: usize,
    /// Leading dimension of C (`>= m`).
    pub ldc: usize,
    /// Elements between consecutive A matrices (0: broadcast).
    pub stride_a: usize,
    /// Elements between consecutive B matrices (0: broadcast).
    pub stride_b: usize,
    /// Elements between consecutive C matrices.
    pub stride_c: usize,
    /// Number of matrices.
    pub batch: usize,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of the old C (`0`: C is not read, so it may hold anything, NaN included).
    pub beta: f32,
    /// Accumulation precision.
    pub compute: Compute,
}

impl Problem {
    /// A packed problem: no transposes, tight leading dimensions and strides, alpha 1, beta 0,
    /// f32 compute.
    pub fn packed(batch: usize, m: usize, n: usize, k: usize) -> Problem {
        Problem::packed_trans(batch, m, n, k, false, false)
    }

    /// A packed problem with the given transposes: A stored `m x k` (`k x m` when `trans_a`),
    /// B stored `k x n` (`n x k` when `trans_b`), leading dimensions equal to the stored rows,
    /// strides equal to the matrix sizes.
    pub fn packed_trans(
        batch: usize,
        m: usize,
        n: usize,
        k: usize,
        trans_a: bool,
        trans_b: bool,
    ) -> Problem {
        let lda = if trans_a { k } else { m };
        let ldb = if trans_b { n } else { k };
        Problem {
            trans_a,
            trans_b,
            m,
            n,
            k,
            lda: lda.max(1),
            ldb: ldb.max(1),
            ldc: m.max(1),
            stride_a: m.saturating_mul(k),
            stride_b: k.saturating_mul(n),
            stride_c: m.saturating_mul(n),
            batch,
            alpha: 1.0,
            beta: 0.0,
            compute: Compute::F32,
        }
    }

    /// Sets `alpha` and `beta`.
    pub fn with_scalars(mut self, alpha: f32, beta: f32) -> Problem {
        self.alpha = alpha;
        self.beta = beta;
        self
    }

    /// Sets the compute type.
    pub fn with_compute(mut self, compute: Compute) -> Problem {
        self.compute = compute;
        self
    }

    /// `(rows, cols)` of A as stored.
    pub fn a_dims(&self) -> (usize, usize) {
        if self.trans_a {
            (self.k, self.m)
        } else {
            (self.m, self.k)
        }
    }

    /// `(rows, cols)` of B as stored.
    pub fn b_dims(&self) -> (usize, usize) {
        if self.trans_b {
            (self.n, self.k)
        } else {
            (self.k, self.n)
        }
    }

    /// Floating-point operations of the whole batch (`2 m n k batch`).
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64 * self.batch as f64
    }

    /// The same problem for the f64 reference ([`crate::reference::gemm`]).
    pub fn to_reference(&self) -> GemmProblem {
        GemmProblem {
            trans_a: self.trans_a,
            trans_b: self.trans_b,
            m: self.m,
            n: self.n,
            k: self.k,
            lda: self.lda,
            ldb: self.ldb,
            ldc: self.ldc,
            stride_a: self.stride_a,
            stride_b: self.stride_b,
            stride_c: self.stride_c,
            batch: self.batch,
            alpha: self.alpha as f64,
            beta: self.beta as f64,
        }
    }

    /// The compute type against `dtype`, the scalars of f16 compute, and the limits of the
    /// cuBLAS API (`int` dimensions, `long long` strides).
    fn check_types_and_limits(&self, dtype: DType) -> Result<()> {
        if self.compute == Compute::F16 && dtype != DType::F16 {
            return Err(Error::invalid(
                "compute",
                format!("f16 compute needs f16 data, got {dtype} (use Compute::F32)"),
            ));
        }
        if self.compute == Compute::F16 {
            for (name, v) in [("alpha", self.alpha), ("beta", self.beta)] {
                if v.is_finite() && v.abs() > 65504.0 {
                    return Err(Error::invalid(
                        name,
                        format!("{v} overflows f16, the scalar type of f16 compute"),
                    ));
                }
            }
        }
        let int_max = i32::MAX as usize;
        for (name, v) in [
            ("m", self.m),
            ("n", self.n),
            ("k", self.k),
            ("batch", self.batch),
            ("lda", self.lda),
            ("ldb", self.ldb),
            ("ldc", self.ldc),
        ] {
            if v > int_max {
                return Err(Error::invalid(
                    name,
                    format!("{v} exceeds {int_max}, the limit of cuBLAS's int arguments"),
                ));
            }
        }
        let long_max = i64::MAX as u64;
        for (name, v) in [
            ("stride_a", self.stride_a),
            ("stride_b", self.stride_b),
            ("stride_c", self.stride_c),
        ] {
            if v as u64 > long_max {
                return Err(Error::invalid(
                    name,
                    format!("{v} exceeds {long_max}, the limit of cuBLAS's stride arguments"),
                ));
            }
        }
        Ok(())
    }

    /// Leading dimensions: at least the rows of the stored matrix (and at least 1).
    fn check_leading_dims(&self) -> Result<()> {
        let (ra, _) = self.a_dims();
        let (rb, _) = self.b_dims();
        for (name, ld, rows, what) in [
            ("lda", self.lda, ra, if self.trans_a { "k" } else { "m" }),
            ("ldb", self.ldb, rb, if self.trans_b { "n" } else { "k" }),
            ("ldc", self.ldc, self.m, "m"),
        ] {
            if ld < rows.max(1) {
                return Err(Error::invalid(
                    name,
                    format!(
                        "{ld} is less than the rows of the stored matrix ({what} = {rows}; \
                         at least 1)"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Checks everything that does not depend on the buffers: compute type against `dtype`,
    /// scalars, the limits of the cuBLAS API (`int` dimensions, `long long` strides), leading
    /// dimensions, `k`, C's stride (no two batches may write the same element) and that every
    /// extent fits in memory. Errors name the argument.
    pub fn check(&self, dtype: DType) -> Result<Validated> {
        self.check_types_and_limits(dtype)?;
        self.check_leading_dims()?;
        if self.m == 0 || self.n == 0 || self.batch == 0 {
            return Ok(Validated::Empty);
        }
        if self.k == 0 {
            return Err(Error::invalid(
                "k",
                "0 with a non-empty C: the result would be beta * C, not a GEMM; scale C instead",
            ));
        }
        if self.batch > 1 && self.stride_c == 0 {
            return Err(Error::invalid(
                "stride_c",
                format!(
                    "0 with batch = {}: every batch would write the same C (a write race)",
                    self.batch
                ),
            ));
        }
        let span_a = span(
            "a",
            "stride_a",
            self.a_dims(),
            self.lda,
            self.stride_a,
            self.batch,
        )?;
        let span_b = span(
            "b",
            "stride_b",
            self.b_dims(),
            self.ldb,
            self.stride_b,
            self.batch,
        )?;
        let span_c = span(
            "c",
            "stride_c",
            (self.m, self.n),
            self.ldc,
            self.stride_c,
            self.batch,
        )?;
        if let Some(t) = c_batches_overlap(self.m, self.n, self.ldc, self.stride_c, self.batch) {
            return Err(Error::invalid(
                "stride_c",
                format!(
                    "{} makes C matrices 0 and {t} share elements (m = {}, n = {}, ldc = {}): \
                     two batches would write the same element",
                    self.stride_c, self.m, self.n, self.ldc
                ),
            ));
        }
        let spans = Spans {
            a: span_a,
            b: span_b,
            c: span_c,
        };
        let bytes_max = isize::MAX as usize / dtype.size();
        for (name, s) in [("a", spans.a), ("b", spans.b), ("c", spans.c)] {
            if s > bytes_max {
                return Err(Error::invalid(
                    name,
                    format!("extent of {s} elements does not fit in the address space"),
                ));
            }
        }
        Ok(Validated::Spans(spans))
    }

    /// [`Problem::check`] plus the buffer lengths (in elements): each buffer must hold the last
    /// element of the last batch. Errors name the buffer (`a`, `b`, `c`) when one matrix does
    /// not fit, or the stride (`stride_a`, ...) when the batches run past the end.
    pub fn check_buffers(
        &self,
        dtype: DType,
        len_a: usize,
        len_b: usize,
        len_c: usize,
    ) -> Result<Validated> {
        let spans = match self.check(dtype)? {
            Validated::Empty => return Ok(Validated::Empty),
            Validated::Spans(s) => s,
        };
        for (name, stride_name, dims, ld, stride, len, total) in [
            (
                "a",
                "stride_a",
                self.a_dims(),
                self.lda,
                self.stride_a,
                len_a,
                spans.a,
            ),
            (
                "b",
                "stride_b",
                self.b_dims(),
                self.ldb,
                self.stride_b,
                len_b,
                spans.b,
            ),
            (
                "c",
                "stride_c",
                (self.m, self.n),
                self.ldc,
                self.stride_c,
                len_c,
                spans.c,
            ),
        ] {
            // One matrix: cannot overflow, since the whole span did not.
            let one = (dims.1 - 1) * ld + dims.0;
            if one > len {
                return Err(Error::invalid(
                    name,
                    format!(
                        "holds {len} elements, but one {}x{} matrix with leading dimension {ld} \
                         needs {one}",
                        dims.0, dims.1
                    ),
                ));
            }
            if total > len {
                return Err(Error::invalid(
                    stride_name,
                    format!(
                        "{stride} with batch = {} reaches element {} of `{name}`, which holds \
                         only {len}",
                        self.batch,
                        total - 1
                    ),
                ));
            }
        }
        Ok(Validated::Spans(spans))
    }
}

/// What [`Problem::check`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Validated {
    /// C is empty (`m`, `n` or `batch` is 0): nothing to do.
    Empty,
    /// The elements each operand spans from its base pointer.
    Spans(Spans),
}

/// Elements from each base pointer to one past the last element used (all batches).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spans {
    /// A's extent.
    pub a: usize,
    /// B's extent.
    pub b: usize,
    /// C's extent.
    pub c: usize,
}

/// `(batch - 1) * stride + (cols - 1) * ld + rows`, with overflow as an error.
fn span(
    name: &str,
    stride_name: &str,
    (rows, cols): (usize, usize),
    ld: usize,
    stride: usize,
    batch: usize,
) -> Result<usize> {
    let one = (cols - 1)
        .checked_mul(ld)
        .and_then(|v| v.checked_add(rows))
        .ok_or_else(|| Error::invalid(name, "one matrix's extent overflows usize"))?;
    (batch - 1)
        .checked_mul(stride)
        .and_then(|v| v.checked_add(one))
        .ok_or_else(|| Error::invalid(stride_name, "the batch's extent overflows usize"))
}

/// The first batch `t >= 1` whose C matrix shares an element with matrix 0, if any. Matrix `t`
/// starts `d = t * stride` elements later; it meets matrix 0 when `d = di + dj * ldc` with
/// `|di| < m`, `|dj| < n`. With `ldc >= m` and `q, r = d / ldc, d % ldc` that is `r < m, q < n`
/// or `r > ldc - m, q + 1 < n`. Equal offsets between other pairs reduce to this one, and no
/// `d` past one matrix's extent can meet it, so the loop is short unless matrices interleave.
pub fn c_batches_overlap(
    m: usize,
    n: usize,
    ldc: usize,
    stride: usize,
    batch: usize,
) -> Option<usize> {
    if batch < 2 || m == 0 || n == 0 {
        return None;
    }
    if stride == 0 {
        return Some(1);
    }
    let extent = (n - 1).saturating_mul(ldc).saturating_add(m);
    let mut d = 0usize;
    for t in 1..batch {
        d = d.checked_add(stride)?;
        if d >= extent {
            return None;
        }
        let (q, r) = (d / ldc, d % ldc);
        if (r < m && q < n) || (r > ldc - m && q + 1 < n) {
            return Some(t);
        }
    }
    None
}

/// Checks the device pointers of a validated problem: each aligned to its element size, and C's
/// extent not overlapping A's or B's (C is written while A and B are read). Extents are the
/// spanned byte ranges (conservative for interleaved operands).
pub fn check_pointers(spans: &Spans, elem: usize, a: u64, b: u64, c: u64) -> Result<()> {
    let op = |name, ptr, span, role| Operand {
        name,
        ptr,
        len: span,
        elem_bytes: elem,
        role,
        need: Need::Span(span),
    };
    check_operands(&[
        op("a", a, spans.a, Role::Input),
        op("b", b, spans.b, Role::Input),
        op("c", c, spans.c, Role::Output),
    ])
}

/// [`check_pointers`] on operands bound by the validator (`a`, `b` read, `c` written, each
/// [`Need::Span`]): every pointer non-null and aligned to its element size, in list order, then
/// the validator's overlap rule (C named, both spans shown).
pub(crate) fn check_operands(ops: &[Operand]) -> Result<()> {
    for o in ops {
        let (p, elem) = (o.ptr, o.elem_bytes);
        if p == 0 {
            return Err(Error::invalid(o.name, "null device pointer"));
        }
        if p % elem as u64 != 0 {
            return Err(Error::invalid(
                o.name,
                format!("device pointer {p:#x} is not aligned to its element size ({elem} bytes)"),
            ));
        }
    }
    validate::check(ops, Aliasing::Distinct).map(drop)
}

/// The largest alignment cuBLASLt asks about (its default assumption).
pub const MAX_ALIGNMENT: u16 = 256;

/// Byte alignment of the operands as cuBLASLt sees them: the largest power of two, at most 256,
/// that divides the base pointer and (when the batch has more than one matrix) the stride in
/// bytes, so that every batch's matrix has at least this alignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Alignment {
    /// A's alignment in bytes.
    pub a: u16,
    /// B's alignment in bytes.
    pub b: u16,
    /// C's alignment in bytes.
    pub c: u16,
}

impl Alignment {
    /// 256 bytes each: what fresh allocations have.
    pub const MAX: Alignment = Alignment {
        a: MAX_ALIGNMENT,
        b: MAX_ALIGNMENT,
        c: MAX_ALIGNMENT,
    };

    /// The alignments of `p`'s operands at the given device pointers.
    pub fn of(p: &Problem, elem: usize, a: u64, b: u64, c: u64) -> Alignment {
        let one = |ptr: u64, stride: usize| {
            let mut bits = ptr | MAX_ALIGNMENT as u64;
            if p.batch > 1 && stride > 0 {
                bits |= (stride as u64).wrapping_mul(elem as u64);
            }
            1u16 << bits.trailing_zeros().min(8)
        };
        Alignment {
            a: one(a, p.stride_a),
            b: one(b, p.stride_b),
            c: one(c, p.stride_c),
        }
    }

    /// Checks that each is a power of two between the element size and 256.
    pub fn check(&self, elem: usize) -> Result<()> {
        for v in [self.a, self.b, self.c] {
            if !v.is_power_of_two() || (v as usize) < elem || v > MAX_ALIGNMENT {
                return Err(Error::invalid(
                    "align",
                    format!("{v} is not a power of two between {elem} and {MAX_ALIGNMENT}"),
                ));
            }
        }
        Ok(())
    }
}

/// What a tuned choice is valid for. Plain integers, cheap to hash (with
/// the choice map's FxHash a lookup costs tens of nanoseconds). The device is the ordinal of
/// the process; the cache file records the device's name, architecture and library versions.
/// Strides are normalised to 0 when `batch == 1` (they are unused then).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    /// Device ordinal in this process.
    pub device: u32,
    /// Element type of A, B and C.
    pub dtype: DType,
    /// Compute type.
    pub compute: Compute,
    /// A transposed.
    pub trans_a: bool,
    /// B transposed.
    pub trans_b: bool,
    /// `beta == 0` (C not read).
    pub beta_zero: bool,
    /// Rows of C.
    pub m: u32,
    /// Columns of C.
    pub n: u32,
    /// Inner dimension.
    pub k: u32,
    /// Matrices.
    pub batch: u32,
    /// Leading dimension of A.
    pub lda: u32,
    /// Leading dimension of B.
    pub ldb: u32,
    /// Leading dimension of C.
    pub ldc: u32,
    /// Batch stride of A (elements).
    pub stride_a: u64,
    /// Batch stride of B (elements).
    pub stride_b: u64,
    /// Batch stride of C (elements).
    pub stride_c: u64,
    /// Operand alignments (bytes).
    pub align: Alignment,
}

impl Key {
    /// The key of a problem; checks the problem first ([`Problem::check`]) and rejects an empty
    /// one (argument `m`).
    pub fn new(device: u32, p: &Problem, dtype: DType, align: Alignment) -> Result<Key> {
        match p.check(dtype)? {
            Validated::Empty => Err(Error::invalid(
                "m",
                "the problem is empty (m, n or batch is 0): there is nothing to tune",
            )),
            Validated::Spans(_) => {
                align.check(dtype.size())?;
                Ok(Key::from_checked(device, p, dtype, align))
            }
        }
    }

    /// The key of a problem that passed [`Problem::check`] (values then fit the fields).
    pub(crate) fn from_checked(device: u32, p: &Problem, dtype: DType, align: Alignment) -> Key {
        let s = |v: usize| if p.batch > 1 { v as u64 } else { 0 };
        Key {
            device,
            dtype,
            compute: p.compute,
            trans_a: p.trans_a,
            trans_b: p.trans_b,
            beta_zero: p.beta == 0.0,
            m: p.m as u32,
            n: p.n as u32,
            k: p.k as u32,
            batch: p.batch as u32,
            lda: p.lda as u32,
            ldb: p.ldb as u32,
            ldc: p.ldc as u32,
            stride_a: s(p.stride_a),
            stride_b: s(p.stride_b),
            stride_c: s(p.stride_c),
            align,
        }
    }

    /// A problem with this key's shape (alpha 1, beta 0 or 1 as the key says).
    pub fn problem(&self) -> Problem {
        Problem {
            trans_a: self.trans_a,
            trans_b: self.trans_b,
            m: self.m as usize,
            n: self.n as usize,
            k: self.k as usize,
            lda: self.lda as usize,
            ldb: self.ldb as usize,
            ldc: self.ldc as usize,
            stride_a: self.stride_a as usize,
            stride_b: self.stride_b as usize,
            stride_c: self.stride_c as usize,
            batch: self.batch as usize,
            alpha: 1.0,
            beta: if self.beta_zero { 0.0 } else { 1.0 },
            compute: self.compute,
        }
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{} {}{} batch {} m {} n {} k {} ld ({}, {}, {}) stride ({}, {}, {}) align ({}, {}, {}){}",
            self.dtype,
            self.compute,
            if self.trans_a { 'T' } else { 'N' },
            if self.trans_b { 'T' } else { 'N' },
            self.batch,
            self.m,
            self.n,
            self.k,
            self.lda,
            self.ldb,
            self.ldc,
            self.stride_a,
            self.stride_b,
            self.stride_c,
            self.align.a,
            self.align.b,
            self.align.c,
            if self.beta_zero { "" } else { " beta!=0" }
        )
    }
}

/// Relative L2 tolerance between two GEMM results of this kind (and against an f64 reference):
/// - f32 data, f32 compute: `1e-5`, widened by `sqrt(k / 4096)` beyond `k = 4096` (rounding
///   errors of a length-`k` f32 dot product grow like `2^-24 * sqrt(k)`: about 4e-6 at 4096);
/// - f16 or bf16 data, f32 compute: `1e-2` (the output rounding is 3e-4 for f16, 2e-3 for bf16);
/// - f16 compute: `max(1e-2, 1e-3 * sqrt(k))` (f16 accumulation: `2^-11 * sqrt(k)` and more).
pub fn tolerance(dtype: DType, compute: Compute, k: usize) -> f64 {
    let k = k.max(1) as f64;
    match (dtype, compute) {
        (_, Compute::F16) => (1e-3 * k.sqrt()).max(1e-2),
        (DType::F32, Compute::F32) => 1e-5 * (k / 4096.0).sqrt().max(1.0),
        (_, Compute::F32) => 1e-2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_rule_matches_brute_force() {
        // Every small layout: the closed form agrees with enumerating the elements.
        for m in 1..4 {
            for n in 1..4 {
                for ldc in m..m + 4 {
                    for stride in 0..(ldc * n + 3) {
                        for batch in 1..5 {
                            let mut seen = std::collections::HashSet::new();
                            let mut brute = None;
                            'outer: for t in 0..batch {
                                for j in 0..n {
                                    for i in 0..m {
                                        if !seen.insert(t * stride + i + j * ldc) {
                                            brute = Some(t);
                                            break 'outer;
                                        }
                                    }
                                }
                            }
                            let got = c_batches_overlap(m, n, ldc, stride, batch);
                            assert_eq!(
                                got.is_some(),
                                brute.is_some(),
                                "m {m} n {n} ldc {ldc} stride {stride} batch {batch}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn alignment_of_pointers_and_strides() {
        let p = Problem::packed(4, 8, 8, 8);
        let al = Alignment::of(&p, 2, 0x1000, 0x1002, 0x1010);
        assert_eq!(
            al,
            Alignment {
                a: 128,
                b: 2,
                c: 16
            }
        ); // stride 64 elements = 128 bytes
        let mut p1 = p;
        p1.batch = 1;
        let al = Alignment::of(&p1, 2, 0x1000, 0x1008, 0x10000);
        assert_eq!(
            al,
            Alignment {
                a: 256,
                b: 8,
                c: 256
            }
        );
    }

    #[test]
    fn tolerances() {
        assert_eq!(tolerance(DType::F32, Compute::F32, 64), 1e-5);
        assert!(tolerance(DType::F32, Compute::F32, 16384) > 1e-5);
        assert_eq!(tolerance(DType::BF16, Compute::F32, 1 << 20), 1e-2);
        assert_eq!(tolerance(DType::F16, Compute::F16, 64), 1e-2);
        assert!((tolerance(DType::F16, Compute::F16, 4096) - 0.064).abs() < 1e-12);
    }
}
