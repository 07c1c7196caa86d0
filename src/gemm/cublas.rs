//! The cuBLAS backend: `cublasGemmStridedBatchedEx`.
//!
//! The `cublasGemmAlgo_t` argument only selects kernels on GPUs older than sm_80; on sm_80+ the
//! cuBLAS documentation says it is ignored, and on the H100 all 43 values give bitwise identical
//! results and times (`docs/CUDNN-FACTS.md`). nnfuse therefore passes `CUBLAS_GEMM_DEFAULT` there and
//! only searches the explicit values on older GPUs.

use std::ffi::c_void;

use cudarc::cublas::sys::{self, cublasGemmAlgo_t as G};

use super::algo::CublasAlgo;
use super::lt::{Ptrs, Scalars};
use super::problem::{Compute, Problem};
use crate::dtype::DType;
use crate::error::{CallExt, Error, Result};

/// Every value of `cublasGemmAlgo_t` nnfuse passes (AUTOTUNE excluded).
const ALGOS: [G; 42] = [
    G::CUBLAS_GEMM_DFALT,
    G::CUBLAS_GEMM_ALGO0,
    G::CUBLAS_GEMM_ALGO1,
    G::CUBLAS_GEMM_ALGO2,
    G::CUBLAS_GEMM_ALGO3,
    G::CUBLAS_GEMM_ALGO4,
    G::CUBLAS_GEMM_ALGO5,
    G::CUBLAS_GEMM_ALGO6,
    G::CUBLAS_GEMM_ALGO7,
    G::CUBLAS_GEMM_ALGO8,
    G::CUBLAS_GEMM_ALGO9,
    G::CUBLAS_GEMM_ALGO10,
    G::CUBLAS_GEMM_ALGO11,
    G::CUBLAS_GEMM_ALGO12,
    G::CUBLAS_GEMM_ALGO13,
    G::CUBLAS_GEMM_ALGO14,
    G::CUBLAS_GEMM_ALGO15,
    G::CUBLAS_GEMM_ALGO16,
    G::CUBLAS_GEMM_ALGO17,
    G::CUBLAS_GEMM_ALGO18,
    G::CUBLAS_GEMM_ALGO19,
    G::CUBLAS_GEMM_ALGO20,
    G::CUBLAS_GEMM_ALGO21,
    G::CUBLAS_GEMM_ALGO22,
    G::CUBLAS_GEMM_ALGO23,
    G::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
    G::CUBLAS_GEMM_ALGO0_TENSOR_OP,
    G::CUBLAS_GEMM_ALGO1_TENSOR_OP,
    G::CUBLAS_GEMM_ALGO2_TENSOR_OP,
    G::CUBLAS_GEMM_ALGO3_TENSOR_OP,
    G::CUBLAS_GEMM_ALGO4_TENSOR_OP,
    G::CUBLAS_GEMM_ALGO5_TENSOR_OP,
    G::CUBLAS_GEMM_ALGO6_TENSOR_OP,
    G::CUBLAS_GEMM_ALGO7_TENSOR_OP,
    G::CUBLAS_GEMM_ALGO8_TENSOR_OP,
    G::CUBLAS_GEMM_ALGO9_TENSOR_OP,
    G::CUBLAS_GEMM_ALGO10_TENSOR_OP,
    G::CUBLAS_GEMM_ALGO11_TENSOR_OP,
    G::CUBLAS_GEMM_ALGO12_TENSOR_OP,
    G::CUBLAS_GEMM_ALGO13_TENSOR_OP,
    G::CUBLAS_GEMM_ALGO14_TENSOR_OP,
    G::CUBLAS_GEMM_ALGO15_TENSOR_OP,
];

fn sys_algo(a: CublasAlgo) -> Option<G> {
    ALGOS.iter().copied().find(|g| *g as i32 == a.0)
}

/// The explicit algorithms a search times on GPUs older than sm_80: `ALGO0..23`, plus
/// `ALGO0..15_TENSOR_OP` for 16-bit data.
pub(crate) fn explicit_algos(dtype: DType) -> Vec<CublasAlgo> {
    let mut v: Vec<CublasAlgo> = (0..=23).filter_map(CublasAlgo::algo).collect();
    if dtype != DType::F32 {
        v.extend((0..=15).filter_map(CublasAlgo::algo_tensor_op));
    }
    v
}

fn data_type(d: DType) -> sys::cudaDataType {
    d.cuda()
}

fn compute_type(c: Compute) -> sys::cublasComputeType_t {
    match c {
        Compute::F32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        Compute::F16 => sys::cublasComputeType_t::CUBLAS_COMPUTE_16F,
    }
}

/// cuBLAS's operation for a transposed (`true`) or plain operand.
fn op(transposed: bool) -> sys::cublasOperation_t {
    if transposed {
        sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        sys::cublasOperation_t::CUBLAS_OP_N
    }
}

/// Queues `cublasGemmStridedBatchedEx` on the handle's stream.
///
/// # Safety
/// `handle` must be live and bound to the stream the operands are used on; the pointers must
/// hold the extents of a problem that passed [`Problem::check`].
pub(crate) unsafe fn gemm(
    handle: sys::cublasHandle_t,
    p: &Problem,
    dtype: DType,
    algo: CublasAlgo,
    ptrs: Ptrs,
) -> Result<()> {
    let g = sys_algo(algo).ok_or_else(|| {
        Error::invalid(
            "algo",
            format!("{} is not a cublasGemmAlgo_t nnfuse passes", algo.0),
        )
    })?;
    let scalars = Scalars::of(p);
    let (alpha, beta) = scalars.ptrs();
    let t = data_type(dtype);
    sys::cublasGemmStridedBatchedEx(
        handle,
        op(p.trans_a),
        op(p.trans_b),
        p.m as i32,
        p.n as i32,
        p.k as i32,
        alpha,
        ptrs.a as *const c_void,
        t,
        p.lda as i32,
        p.stride_a as i64,
        ptrs.b as *const c_void,
        t,
        p.ldb as i32,
        p.stride_b as i64,
        beta,
        ptrs.c as *mut c_void,
        t,
        p.ldc as i32,
        p.stride_c as i64,
        p.batch as i32,
        compute_type(p.compute),
        g,
    )
    .result()
    .call("cublasGemmStridedBatchedEx")
}

/// Queues `cublasGemmBatchedEx` (the default algorithm) on the handle's stream: `arrays` holds
/// `p.batch` device addresses of A, then as many of B, then of C. `p`'s strides are not used.
///
/// # Safety
/// As [`gemm`]; `arrays` is a device address of `3 * p.batch` addresses written (in stream
/// order) before this call, each of a matrix with `p`'s dimensions and leading dimensions.
pub(crate) unsafe fn gemm_pointer_arrays(
    handle: sys::cublasHandle_t,
    p: &Problem,
    dtype: DType,
    arrays: u64,
) -> Result<()> {
    let g = sys_algo(CublasAlgo::DEFAULT)
        .ok_or_else(|| Error::invalid("algo", "the default cublasGemmAlgo_t is not mapped"))?;
    let scalars = Scalars::of(p);
    let (alpha, beta) = scalars.ptrs();
    let t = data_type(dtype);
    let batch = p.batch as u64;
    sys::cublasGemmBatchedEx(
        handle,
        op(p.trans_a),
        op(p.trans_b),
        p.m as i32,
        p.n as i32,
        p.k as i32,
        alpha,
        arrays as *const *const c_void,
        t,
        p.lda as i32,
        (arrays + 8 * batch) as *const *const c_void,
        t,
        p.ldb as i32,
        beta,
        (arrays + 16 * batch) as *const *mut c_void,
        t,
        p.ldc as i32,
        p.batch as i32,
        compute_type(p.compute),
        g,
    )
    .result()
    .call("cublasGemmBatchedEx")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_known_value_maps() {
        for i in -1..=200 {
            assert_eq!(
                sys_algo(CublasAlgo(i)).is_some(),
                CublasAlgo(i).is_known(),
                "{i}"
            );
        }
        assert_eq!(explicit_algos(DType::F32).len(), 24);
        assert_eq!(explicit_algos(DType::F16).len(), 40);
    }
}
