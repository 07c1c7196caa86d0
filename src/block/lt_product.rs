//! A plain cuBLASLt product `D = op(A) · op(B)` (alpha 1, beta 0, C = D) whose descriptors and
//! algorithm (the heuristic's first) are made once: the folded backward's [MM | bias]
//! (`fold_backward.rs`). Through `cublasGemmEx` such a call cost about 20–30 µs of host time on
//! the H100 (its algorithm chosen on every call); a cached cuBLASLt call a few µs. Compute `CUBLAS_COMPUTE_32F`, f32 scalars.
//! Owned descriptors (destroyed on drop; a failed destroy only leaks); no decisions here.

use std::ffi::c_void;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublaslt::{result as lt, sys};

use crate::dtype::DType;
use crate::error::{CallExt, Error, Result};
use crate::gemm::lt::{data_type, heuristic, set_desc, Layout, MatmulDesc as Desc};
use crate::gemm::{Alignment, WORKSPACE_BYTES};

/// Alignment (bytes) the algorithm may assume of every operand (the caller checks it).
pub(crate) const PRODUCT_ALIGNMENT: u64 = 16;

/// One product's shape: `[m, n, k]`, transposes of A and B, leading dimensions of A, B, C.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProductShape {
    pub mnk: [usize; 3],
    pub trans: [bool; 2],
    pub ld: [usize; 3],
}

/// The descriptors and algorithm of one product.
pub(crate) struct LtProduct {
    desc: Desc,
    a: Layout,
    b: Layout,
    c: Layout,
    algo: sys::cublasLtMatmulAlgo_t,
}

// SAFETY: opaque host objects written only in `new`, then read-only inputs of `cublasLtMatmul`
// (as `lt_epilogue::EpilogueGemm`), destroyed once in Drop.
unsafe impl Send for LtProduct {}
// SAFETY: see Send.
unsafe impl Sync for LtProduct {}

fn op(t: bool) -> i32 {
    if t {
        cublasOperation_t::CUBLAS_OP_T as i32
    } else {
        cublasOperation_t::CUBLAS_OP_N as i32
    }
}

impl LtProduct {
    /// Describes `s` with A and B of `dtype` and C of `dtype` or f32 (`f32_out`), and asks the
    /// heuristic for an algorithm. [`Error::NotSupported`] when cuBLASLt has none.
    pub(crate) fn new(
        h: sys::cublasLtHandle_t,
        s: &ProductShape,
        dtype: DType,
        f32_out: bool,
    ) -> Result<LtProduct> {
        use sys::cublasLtMatmulDescAttributes_t as D;
        let desc = Desc(
            lt::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType::CUDA_R_32F,
            )
            .call("cublasLtMatmulDescCreate")?,
        );
        // SAFETY: live descriptor; TRANSA / TRANSB are int32_t.
        unsafe {
            set_desc(desc.0, D::CUBLASLT_MATMUL_DESC_TRANSA, &op(s.trans[0]))?;
            set_desc(desc.0, D::CUBLASLT_MATMUL_DESC_TRANSB, &op(s.trans[1]))?;
        }
        let [m, n, k] = s.mnk;
        let layout =
            |t: sys::cudaDataType, rows: usize, cols: usize, ld: usize| -> Result<Layout> {
                Ok(Layout(
                    lt::create_matrix_layout(t, rows as u64, cols as u64, ld as i64)
                        .call("cublasLtMatrixLayoutCreate")?,
                ))
            };
        let t = data_type(dtype);
        let (ar, ac) = if s.trans[0] { (k, m) } else { (m, k) };
        let (br, bc) = if s.trans[1] { (n, k) } else { (k, n) };
        let a = layout(t, ar, ac, s.ld[0])?;
        let b = layout(t, br, bc, s.ld[1])?;
        let tc = if f32_out {
            sys::cudaDataType::CUDA_R_32F
        } else {
            t
        };
        let c = layout(tc, m, n, s.ld[2])?;
        let all = PRODUCT_ALIGNMENT as u16;
        let found = heuristic(
            h,
            &desc,
            [&a, &b, &c],
            Alignment {
                a: all,
                b: all,
                c: all,
            },
            WORKSPACE_BYTES,
            1,
        )?;
        let Some(&(algo, _)) = found.first() else {
            return Err(Error::NotSupported(format!(
                "cuBLASLt has no algorithm for the {m}x{n}x{k} {dtype} product"
            )));
        };
        Ok(LtProduct {
            desc,
            a,
            b,
            c,
            algo,
        })
    }

    /// Queues `D = op(A) · op(B)` into `d`.
    ///
    /// # Safety
    /// Live handle; the pointers hold the extents of the shape given to `new`, are
    /// [`PRODUCT_ALIGNMENT`]-aligned, D disjoint from A and B; `ws` holds [`WORKSPACE_BYTES`]
    /// bytes for the queued work.
    pub(crate) unsafe fn run(
        &self,
        h: sys::cublasLtHandle_t,
        [a, b, d]: [u64; 3],
        ws: u64,
        stream: sys::cudaStream_t,
    ) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        lt::matmul(
            h,
            self.desc.0,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            a as *const c_void,
            self.a.0,
            b as *const c_void,
            self.b.0,
            d as *const c_void,
            self.c.0,
            d as *mut c_void,
            self.c.0,
            &self.algo,
            ws as *mut c_void,
            WORKSPACE_BYTES,
            stream,
        )
        .call("cublasLtMatmul")
    }
}
