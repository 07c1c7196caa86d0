//! The cuBLASLt backend: `cublasLtMatmul` on strided batched column-major layouts, with its
//! descriptors owned by RAII types (destroyed on drop; a failed destroy only leaks).
//!
//! Descriptor contents (cuBLASLt API reference, "cublasLtMatmulDescAttributes_t",
//! "cublasLtMatrixLayoutAttribute_t", "cublasLtMatmulPreferenceAttributes_t"):
//! - matmul: compute type `CUBLAS_COMPUTE_32F` with scale type `CUDA_R_32F`, or
//!   `CUBLAS_COMPUTE_16F` with `CUDA_R_16F` (alpha and beta are then `__half`);
//!   `CUBLASLT_MATMUL_DESC_TRANSA/B` as `int32_t` `cublasOperation_t`; pointer mode host.
//! - layouts: column order (the default), rows/cols of the matrix as stored, `ld` as `int64_t`;
//!   for `batch > 1` `CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT` (`int32_t`) and
//!   `CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET` (`int64_t`, elements) on A, B and C. C and D
//!   are the same matrix (in-place, one layout).
//! - preference: `CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES` (`uint64_t`) and
//!   `CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_{A,B,C,D}_BYTES` (`uint32_t`) from the operands' real
//!   alignment, so that no candidate needs more alignment than the pointers have.

use std::ffi::{c_int, c_void};
use std::mem::size_of;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublaslt::{result as lt, sys};
use half::f16;

use super::algo::{LtAlgo, LtConfig};
use super::problem::{Alignment, Compute, Problem};
use crate::dtype::DType;
use crate::error::{CallExt, Error, Result};

/// Workspace nnfuse offers cuBLASLt (the preference's maximum and the size passed to every
/// `cublasLtMatmul`).
pub const WORKSPACE_BYTES: usize = 32 << 20;

pub(crate) fn data_type(d: DType) -> sys::cudaDataType {
    match d {
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
    }
}

fn compute_type(c: Compute) -> sys::cublasComputeType_t {
    match c {
        Compute::F32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        Compute::F16 => sys::cublasComputeType_t::CUBLAS_COMPUTE_16F,
    }
}

fn scale_type(c: Compute) -> sys::cudaDataType {
    match c {
        Compute::F32 => sys::cudaDataType::CUDA_R_32F,
        Compute::F16 => sys::cudaDataType::CUDA_R_16F,
    }
}

/// alpha and beta in the scale type of the compute type, kept alive across the call.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Scalars {
    F32([f32; 2]),
    F16([f16; 2]),
}

impl Scalars {
    pub(crate) fn of(p: &Problem) -> Scalars {
        match p.compute {
            Compute::F32 => Scalars::F32([p.alpha, p.beta]),
            Compute::F16 => Scalars::F16([f16::from_f32(p.alpha), f16::from_f32(p.beta)]),
        }
    }

    /// Host pointers to alpha and beta.
    pub(crate) fn ptrs(&self) -> (*const c_void, *const c_void) {
        match self {
            Scalars::F32(v) => (
                &v[0] as *const f32 as *const c_void,
                &v[1] as *const f32 as *const c_void,
            ),
            Scalars::F16(v) => (
                &v[0] as *const f16 as *const c_void,
                &v[1] as *const f16 as *const c_void,
            ),
        }
    }
}

/// Device pointers of the operands (C is read when beta != 0 and written).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ptrs {
    pub a: u64,
    pub b: u64,
    pub c: u64,
}

pub(crate) struct MatmulDesc(pub(crate) sys::cublasLtMatmulDesc_t);

impl Drop for MatmulDesc {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatmulDescCreate, destroyed once here. A failure only leaks.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}

pub(crate) struct Layout(pub(crate) sys::cublasLtMatrixLayout_t);

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatrixLayoutCreate, destroyed once here.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}

struct Preference(sys::cublasLtMatmulPreference_t);

impl Drop for Preference {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatmulPreferenceCreate, destroyed once here.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

/// # Safety
/// `desc` must be live; `T` must be the attribute's documented type.
pub(crate) unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> Result<()> {
    lt::set_matmul_desc_attribute(desc, attr, v as *const T as *const c_void, size_of::<T>())
        .call("cublasLtMatmulDescSetAttribute")
}

/// # Safety
/// As [`set_desc`].
unsafe fn set_layout<T>(
    l: sys::cublasLtMatrixLayout_t,
    attr: sys::cublasLtMatrixLayoutAttribute_t,
    v: &T,
) -> Result<()> {
    lt::set_matrix_layout_attribute(l, attr, v as *const T as *const c_void, size_of::<T>())
        .call("cublasLtMatrixLayoutSetAttribute")
}

/// # Safety
/// As [`set_desc`].
unsafe fn set_pref<T>(
    p: sys::cublasLtMatmulPreference_t,
    attr: sys::cublasLtMatmulPreferenceAttributes_t,
    v: &T,
) -> Result<()> {
    lt::set_matmul_pref_attribute(p, attr, v as *const T as *const c_void, size_of::<T>())
        .call("cublasLtMatmulPreferenceSetAttribute")
}

fn zeroed_result() -> sys::cublasLtMatmulHeuristicResult_t {
    // SAFETY: a plain C struct of integers, floats and a status enum whose 0 is
    // CUBLAS_STATUS_SUCCESS: all-zero bytes are a valid value.
    unsafe { std::mem::zeroed() }
}

/// Up to `count` (1 to 64) candidates of `cublasLtMatmulAlgoGetHeuristic` for the matmul
/// descriptor `desc` and the layouts of A, B and C (= D), with operands aligned to `align`
/// bytes and a workspace of at most `max_workspace` bytes: `(algorithm, workspace bytes)` in the
/// heuristic's order, only those it reports usable; empty when cuBLASLt supports none. The one
/// heuristic query of the GEMM search and of the folded block's epilogue GEMM.
pub(crate) fn heuristic(
    handle: sys::cublasLtHandle_t,
    desc: &MatmulDesc,
    [a, b, c]: [&Layout; 3],
    align: Alignment,
    max_workspace: usize,
    count: usize,
) -> Result<Vec<(sys::cublasLtMatmulAlgo_t, usize)>> {
    let pref = Preference(lt::create_matmul_pref().call("cublasLtMatmulPreferenceCreate")?);
    use sys::cublasLtMatmulPreferenceAttributes_t as P;
    let ws = max_workspace as u64;
    // SAFETY: live preference; MAX_WORKSPACE_BYTES is uint64_t, MIN_ALIGNMENT_* uint32_t.
    unsafe {
        set_pref(pref.0, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws)?;
        for (attr, bytes) in [
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align.a),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align.b),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align.c),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align.c),
        ] {
            set_pref(pref.0, attr, &(bytes as u32))?;
        }
    }
    let count = count.clamp(1, 64);
    let mut results = vec![zeroed_result(); count];
    let mut returned: c_int = 0;
    // SAFETY: the caller's descriptors are live; `results` holds `count` entries.
    let status = unsafe {
        sys::cublasLtMatmulAlgoGetHeuristic(
            handle,
            desc.0,
            a.0,
            b.0,
            c.0,
            c.0,
            pref.0,
            count as c_int,
            results.as_mut_ptr(),
            &mut returned,
        )
    };
    if status == sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED {
        return Ok(Vec::new());
    }
    status.result().call("cublasLtMatmulAlgoGetHeuristic")?;
    results.truncate((returned.max(0) as usize).min(count));
    Ok(results
        .into_iter()
        .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
        .map(|r| (r.algo, r.workspaceSize))
        .collect())
}

/// The descriptors of one problem: a matmul descriptor and the layouts of A, B and C (= D).
/// They depend only on the problem's [`super::Key`] (types, transposes, m, n, k, leading
/// dimensions, batch and strides; alpha and beta are passed per call), so one set serves every
/// candidate of a search and every later call of a cached cuBLASLt choice.
pub(crate) struct LtDescriptors {
    desc: MatmulDesc,
    a: Layout,
    b: Layout,
    c: Layout,
}

// SAFETY: an LtDescriptors owns four cuBLASLt descriptors: opaque host-memory objects, not bound to a
// thread, a device, a handle or a stream. `LtDescriptors::new` is the only code that writes them (the
// `*SetAttribute` calls, before the LtDescriptors exists as a value); afterwards every method takes
// `&self` and only passes them as read-only inputs to `cublasLtMatmulAlgoGetHeuristic`,
// `cublasLtMatmulAlgoCheck` and `cublasLtMatmul`, and `Drop` destroys them once with exclusive
// access (the cache shares descriptors through `Arc`, so they outlive every call that uses it).
// Moving an LtDescriptors to another thread, and several threads reading it at once, are therefore sound.
unsafe impl Send for LtDescriptors {}
// SAFETY: see the `Send` impl: after construction the descriptors are only read.
unsafe impl Sync for LtDescriptors {}

impl LtDescriptors {
    /// Describes a problem that passed [`Problem::check`].
    pub(crate) fn new(p: &Problem, dtype: DType) -> Result<LtDescriptors> {
        let desc = MatmulDesc(
            lt::create_matmul_desc(compute_type(p.compute), scale_type(p.compute))
                .call("cublasLtMatmulDescCreate")?,
        );
        let op = |t: bool| -> i32 {
            if t {
                cublasOperation_t::CUBLAS_OP_T as i32
            } else {
                cublasOperation_t::CUBLAS_OP_N as i32
            }
        };
        use sys::cublasLtMatmulDescAttributes_t as D;
        // SAFETY: live descriptor; TRANSA/TRANSB are int32_t.
        unsafe {
            set_desc(desc.0, D::CUBLASLT_MATMUL_DESC_TRANSA, &op(p.trans_a))?;
            set_desc(desc.0, D::CUBLASLT_MATMUL_DESC_TRANSB, &op(p.trans_b))?;
        }
        let layout = |(rows, cols): (usize, usize), ld: usize, stride: usize| -> Result<Layout> {
            let l = Layout(
                lt::create_matrix_layout(data_type(dtype), rows as u64, cols as u64, ld as i64)
                    .call("cublasLtMatrixLayoutCreate")?,
            );
            if p.batch > 1 {
                use sys::cublasLtMatrixLayoutAttribute_t as L;
                let count = p.batch as i32;
                let offset = stride as i64;
                // SAFETY: live layout; BATCH_COUNT is int32_t, STRIDED_BATCH_OFFSET int64_t.
                unsafe {
                    set_layout(l.0, L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count)?;
                    set_layout(l.0, L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &offset)?;
                }
            }
            Ok(l)
        };
        let a = layout(p.a_dims(), p.lda, p.stride_a)?;
        let b = layout(p.b_dims(), p.ldb, p.stride_b)?;
        let c = layout((p.m, p.n), p.ldc, p.stride_c)?;
        Ok(LtDescriptors { desc, a, b, c })
    }

    /// Up to `count` heuristic candidates (`cublasLtMatmulAlgoGetHeuristic`) for operands with
    /// alignment `align` and a workspace of at most `max_workspace` bytes, as
    /// `(algorithm, workspace bytes)`, in the heuristic's order. None supported: empty.
    pub(crate) fn heuristics(
        &self,
        handle: sys::cublasLtHandle_t,
        align: Alignment,
        max_workspace: usize,
        count: usize,
    ) -> Result<Vec<(LtAlgo, usize)>> {
        let found = heuristic(
            handle,
            &self.desc,
            [&self.a, &self.b, &self.c],
            align,
            max_workspace,
            count,
        )?;
        Ok(found
            .into_iter()
            .map(|(algo, ws)| (LtAlgo(algo.data), ws))
            .collect())
    }

    /// `cublasLtMatmulAlgoCheck`: whether `algo` can run this problem; its workspace bytes.
    pub(crate) fn check(&self, handle: sys::cublasLtHandle_t, algo: &LtAlgo) -> Result<usize> {
        let raw = sys::cublasLtMatmulAlgo_t { data: algo.0 };
        let mut res = zeroed_result();
        // SAFETY: live descriptors; valid in/out pointers.
        unsafe {
            sys::cublasLtMatmulAlgoCheck(
                handle,
                self.desc.0,
                self.a.0,
                self.b.0,
                self.c.0,
                self.c.0,
                &raw,
                &mut res,
            )
        }
        .result()
        .call("cublasLtMatmulAlgoCheck")?;
        res.state
            .result()
            .call("cublasLtMatmulAlgoCheck (result state)")?;
        Ok(res.workspaceSize)
    }

    /// Queues `cublasLtMatmul` on `stream`: `C = alpha op(A) op(B) + beta C`.
    ///
    /// # Safety
    /// The pointers must hold the problem's extents for the duration of the queued work, the
    /// workspace `workspace_bytes` bytes; `algo` must have passed [`LtDescriptors::check`] for these descriptors
    /// with at most `workspace_bytes` of workspace.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn matmul(
        &self,
        handle: sys::cublasLtHandle_t,
        algo: &LtAlgo,
        scalars: &Scalars,
        ptrs: Ptrs,
        workspace: u64,
        workspace_bytes: usize,
        stream: sys::cudaStream_t,
    ) -> Result<()> {
        let raw = sys::cublasLtMatmulAlgo_t { data: algo.0 };
        let (alpha, beta) = scalars.ptrs();
        lt::matmul(
            handle,
            self.desc.0,
            alpha,
            beta,
            ptrs.a as *const c_void,
            self.a.0,
            ptrs.b as *const c_void,
            self.b.0,
            ptrs.c as *const c_void,
            self.c.0,
            ptrs.c as *mut c_void,
            self.c.0,
            &raw,
            workspace as *mut c_void,
            workspace_bytes,
            stream,
        )
        .call("cublasLtMatmul")
    }
}

/// Reads an integer attribute of unknown width (1, 2, 4 or 8 bytes) through `call(buf, size,
/// written)`: the size is asked first (`sizeInBytes = 0`), with the widths tried in turn if
/// that fails.
fn read_int(
    mut call: impl FnMut(*mut c_void, usize, *mut usize) -> sys::cublasStatus_t,
) -> Option<u64> {
    let ok = sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS;
    let mut needed = 0usize;
    let first = if call(std::ptr::null_mut(), 0, &mut needed) == ok {
        needed
    } else {
        0
    };
    for size in [first, 4, 2, 8, 1] {
        if !matches!(size, 1 | 2 | 4 | 8) {
            continue;
        }
        let mut buf = [0u8; 8];
        let mut written = 0usize;
        if call(buf.as_mut_ptr() as *mut c_void, size, &mut written) != ok {
            continue;
        }
        return Some(match size {
            1 => buf[0] as u64,
            2 => u16::from_ne_bytes([buf[0], buf[1]]) as u64,
            4 => u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]) as u64,
            _ => u64::from_ne_bytes(buf),
        });
    }
    None
}

fn config_attr(
    raw: &sys::cublasLtMatmulAlgo_t,
    attr: sys::cublasLtMatmulAlgoConfigAttributes_t,
) -> Result<u64> {
    // SAFETY: `raw` is a live algo struct; `buf` holds `size` bytes (read_int's contract).
    read_int(|buf, size, w| unsafe {
        sys::cublasLtMatmulAlgoConfigGetAttribute(raw, attr, buf, size, w)
    })
    .ok_or_else(|| Error::Cublas {
        call: "cublasLtMatmulAlgoConfigGetAttribute",
        status: format!("{attr:?} could not be read at any integer width"),
    })
}

/// The alignment (bytes) `algo` needs for A, B, C and D (`CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_*`);
/// 256 (cuBLASLt's default assumption) where a capability cannot be read.
pub(crate) fn min_alignment(algo: &LtAlgo) -> [u64; 4] {
    let raw = sys::cublasLtMatmulAlgo_t { data: algo.0 };
    use sys::cublasLtMatmulAlgoCapAttributes_t as C;
    [
        C::CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES,
        C::CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_B_BYTES,
        C::CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_C_BYTES,
        C::CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_D_BYTES,
    ]
    .map(|attr| {
        // SAFETY: as config_attr.
        read_int(|buf, size, w| unsafe {
            sys::cublasLtMatmulAlgoCapGetAttribute(&raw, attr, buf, size, w)
        })
        .unwrap_or(256)
    })
}

/// Whether operands aligned as `have` satisfy alignment needs `need` (bytes for A, B, C, D, as
/// [`min_alignment`] returns them); the error says which operand falls short.
pub(crate) fn alignment_suffices(need: [u64; 4], have: Alignment) -> Result<()> {
    let have = [have.a, have.b, have.c, have.c];
    for (i, name) in ["a", "b", "c", "c (as D)"].iter().enumerate() {
        if need[i] > have[i] as u64 {
            return Err(Error::NotSupported(format!(
                "the cuBLASLt algorithm needs {}-byte alignment of {name}, which has {}",
                need[i], have[i]
            )));
        }
    }
    Ok(())
}

/// Whether operands aligned as `align` satisfy `algo`'s alignment needs; the error says which.
pub(crate) fn check_alignment(algo: &LtAlgo, align: Alignment) -> Result<()> {
    alignment_suffices(min_alignment(algo), align)
}

/// `algo` with its K dimension split `splits` ways and the parts added in the compute type in
/// the workspace (`CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE`): a variant for products with few
/// output tiles and a long K, where one tile per block leaves most SMs idle. `Err` where the
/// algorithm takes no split (its `CUBLASLT_ALGO_CAP_SPLITK_SUPPORT` is 0) or cuBLASLt refuses
/// the attributes; [`LtDescriptors::check`] still decides whether it runs the problem.
pub(crate) fn with_split_k(algo: &LtAlgo, splits: u32) -> Result<LtAlgo> {
    let mut raw = sys::cublasLtMatmulAlgo_t { data: algo.0 };
    use sys::cublasLtMatmulAlgoCapAttributes_t as C;
    use sys::cublasLtMatmulAlgoConfigAttributes_t as A;
    // SAFETY: as config_attr.
    let support = read_int(|buf, size, w| unsafe {
        sys::cublasLtMatmulAlgoCapGetAttribute(
            &raw,
            C::CUBLASLT_ALGO_CAP_SPLITK_SUPPORT,
            buf,
            size,
            w,
        )
    });
    if support != Some(1) {
        return Err(Error::NotSupported(
            "the cuBLASLt algorithm does not split K".into(),
        ));
    }
    let splits = splits as i32;
    let scheme = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
    let set = |raw: &mut sys::cublasLtMatmulAlgo_t, attr, v: *const c_void, n| {
        // SAFETY: live algo struct; `v` points at `n` bytes of the attribute's type.
        unsafe { sys::cublasLtMatmulAlgoConfigSetAttribute(raw, attr, v, n) }
            .result()
            .call("cublasLtMatmulAlgoConfigSetAttribute")
    };
    set(
        &mut raw,
        A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
        &splits as *const i32 as *const c_void,
        size_of::<i32>(),
    )?;
    set(
        &mut raw,
        A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
        &scheme as *const u32 as *const c_void,
        size_of::<u32>(),
    )?;
    Ok(LtAlgo(raw.data))
}

/// The readable attributes of an algorithm (host-only calls into cuBLASLt).
pub(crate) fn config_of(algo: &LtAlgo) -> Result<LtConfig> {
    let raw = sys::cublasLtMatmulAlgo_t { data: algo.0 };
    use sys::cublasLtMatmulAlgoConfigAttributes_t as A;
    let get = |a| config_attr(&raw, a);
    Ok(LtConfig {
        algo_id: get(A::CUBLASLT_ALGO_CONFIG_ID)? as u32 as i32,
        tile: get(A::CUBLASLT_ALGO_CONFIG_TILE_ID)? as u32,
        stages: get(A::CUBLASLT_ALGO_CONFIG_STAGES_ID)? as u32,
        splitk: get(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM)? as u32,
        reduction: get(A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME)? as u32,
        swizzle: get(A::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING)? as u32,
        custom: get(A::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION)? as u32,
        inner_shape: get(A::CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID).unwrap_or(0) as u32,
        cluster_shape: get(A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID).unwrap_or(0) as u32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_needs() {
        let have = Alignment {
            a: 16,
            b: 2,
            c: 256,
        };
        assert!(alignment_suffices([16, 2, 256, 256], have).is_ok());
        assert!(alignment_suffices([0; 4], have).is_ok());
        let e = alignment_suffices([16, 16, 16, 16], have).unwrap_err();
        assert!(e.to_string().contains("of b"), "{e}");
        let e = alignment_suffices([16, 2, 16, 512], have).unwrap_err();
        assert!(e.to_string().contains("c (as D)"), "{e}");
    }
}
