//! The GEMM route's cuBLASLt matmul: `D = epilogue(alpha · op(A) · B + beta · C)` with the
//! epilogue `BIAS` or `RELU_BIAS` (cuBLASLt API reference, `cublasLtEpilogue_t`: the bias
//! vector has one entry per row of D, is broadcast over the columns and added before the
//! ReLU; its type defaults to D's). C (the shortcut, beta = 1) and D (the output) are separate
//! matrices of one layout. Compute `CUBLAS_COMPUTE_32F` with f32 scale for every data type: f32
//! data stays true f32 (no TF32).
//!
//! Descriptors are owned (destroyed on drop; a failed destroy only leaks), built once per
//! problem and ReLU flag with the bias pointer fixed (the block owns the bias).

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublaslt::{result as lt, sys};

use super::plan::GemmGeometry;
use crate::dtype::DType;
use crate::error::{CallExt, Error, Result};
use crate::gemm::lt::{data_type, heuristic, set_desc, Layout, MatmulDesc as Desc};
use crate::gemm::Alignment;
use crate::gemm::WORKSPACE_BYTES;

/// Alignment (bytes) the chosen algorithm may assume of every operand; calls with operands
/// aligned less take the unfused route.
pub(crate) const OPERAND_ALIGNMENT: u64 = 16;

/// The operands of one call (device addresses).
#[derive(Debug, Clone, Copy)]
pub(crate) struct GemmPtrs {
    /// The folded filter.
    pub a: u64,
    /// The input (pointwise) or its columns.
    pub b: u64,
    /// The shortcut; read only when `beta != 0`.
    pub c: u64,
    /// The output.
    pub d: u64,
}

/// Heuristic candidates asked of cuBLASLt; the first call times them (`decide`).
pub(crate) const MAX_ALGOS: usize = 4;

/// One problem's descriptors, cuBLASLt's heuristic candidates (in its order) and the one in
/// use (the first until the first call's timing chooses).
pub(crate) struct EpilogueGemm {
    desc: Desc,
    a: Layout,
    b: Layout,
    cd: Layout,
    algos: Vec<sys::cublasLtMatmulAlgo_t>,
    chosen: AtomicUsize,
}

// SAFETY: the descriptors are opaque host objects written only in `new`; afterwards they are
// read-only inputs of `cublasLtMatmul` (as `gemm::lt::LtDescriptors`), destroyed once in Drop.
unsafe impl Send for EpilogueGemm {}
// SAFETY: see Send.
unsafe impl Sync for EpilogueGemm {}

impl EpilogueGemm {
    /// Describes `g` in `dtype` with the bias at `bias` (`m` elements of `dtype`) and ReLU when
    /// `relu`, and asks the heuristic for an algorithm. [`Error::NotSupported`] when cuBLASLt
    /// has none.
    pub(crate) fn new(
        h: sys::cublasLtHandle_t,
        g: &GemmGeometry,
        dtype: DType,
        relu: bool,
        bias: u64,
    ) -> Result<EpilogueGemm> {
        use sys::cublasLtMatmulDescAttributes_t as D;
        let desc = Desc(
            lt::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType::CUDA_R_32F,
            )
            .call("cublasLtMatmulDescCreate")?,
        );
        let epilogue = if relu {
            sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_RELU_BIAS
        } else {
            sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS
        };
        let bias_ptr = bias as *const c_void;
        // SAFETY: live descriptor; TRANSA/B int32_t, EPILOGUE uint32_t, BIAS_POINTER void*.
        unsafe {
            set_desc(
                desc.0,
                D::CUBLASLT_MATMUL_DESC_TRANSA,
                &(cublasOperation_t::CUBLAS_OP_T as i32),
            )?;
            set_desc(
                desc.0,
                D::CUBLASLT_MATMUL_DESC_TRANSB,
                &(cublasOperation_t::CUBLAS_OP_N as i32),
            )?;
            set_desc(desc.0, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &(epilogue as u32))?;
            set_desc(desc.0, D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr)?;
        }
        let layout = |rows: usize, cols: usize, ld: usize| -> Result<Layout> {
            Ok(Layout(
                lt::create_matrix_layout(data_type(dtype), rows as u64, cols as u64, ld as i64)
                    .call("cublasLtMatrixLayoutCreate")?,
            ))
        };
        let a = layout(g.k, g.m, g.k)?;
        let b = layout(g.k, g.n, g.k)?;
        let cd = layout(g.m, g.n, g.m)?;
        let all = OPERAND_ALIGNMENT as u16;
        let found = heuristic(
            h,
            &desc,
            [&a, &b, &cd],
            Alignment {
                a: all,
                b: all,
                c: all,
            },
            WORKSPACE_BYTES,
            MAX_ALGOS,
        )?;
        if found.is_empty() {
            return Err(Error::NotSupported(format!(
                "cuBLASLt has no algorithm for the {}x{}x{} {dtype} GEMM with the {} epilogue",
                g.m,
                g.n,
                g.k,
                if relu { "RELU_BIAS" } else { "BIAS" }
            )));
        }
        let algos: Vec<_> = found
            .into_iter()
            .filter(|&(_, ws)| ws <= WORKSPACE_BYTES)
            .map(|(algo, _)| algo)
            .collect();
        if algos.is_empty() {
            return Err(Error::NotSupported(
                "cuBLASLt's heuristic returned no usable algorithm".into(),
            ));
        }
        Ok(EpilogueGemm {
            desc,
            a,
            b,
            cd,
            algos,
            chosen: AtomicUsize::new(0),
        })
    }

    /// The heuristic's candidates.
    pub(crate) fn algos(&self) -> usize {
        self.algos.len()
    }

    /// Makes candidate `i` the one [`EpilogueGemm::run`] uses (out of range: ignored).
    pub(crate) fn choose(&self, i: usize) {
        if i < self.algos.len() {
            self.chosen.store(i, Ordering::Relaxed);
        }
    }

    /// Queues the matmul with candidate `algo` (None: the chosen one):
    /// `D = epilogue(op(A) B + beta C)`.
    ///
    /// # Safety
    /// Live handle; the pointers hold the problem's extents for the queued work and are
    /// [`OPERAND_ALIGNMENT`]-aligned, D disjoint from A, B and C; `ws` holds `ws_bytes >=`
    /// [`WORKSPACE_BYTES`] bytes; the bias given to `new` still lives.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn run(
        &self,
        algo: Option<usize>,
        h: sys::cublasLtHandle_t,
        p: GemmPtrs,
        beta: f32,
        ws: u64,
        ws_bytes: usize,
        stream: sys::cudaStream_t,
    ) -> Result<()> {
        let alpha = 1.0f32;
        let i = algo.unwrap_or_else(|| self.chosen.load(Ordering::Relaxed));
        let Some(raw) = self.algos.get(i) else {
            return Err(Error::NotSupported(format!("no cuBLASLt candidate {i}")));
        };
        lt::matmul(
            h,
            self.desc.0,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            p.a as *const c_void,
            self.a.0,
            p.b as *const c_void,
            self.b.0,
            p.c as *const c_void,
            self.cd.0,
            p.d as *mut c_void,
            self.cd.0,
            raw,
            ws as *mut c_void,
            ws_bytes,
            stream,
        )
        .call("cublasLtMatmul")
    }
}
