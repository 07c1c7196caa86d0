//! The bare vendor calls the host-overhead bench sets next to nnfuse's: each the same work with
//! everything prepared beforehand (descriptors, workspace, raw pointers), so its host time is
//! the vendor's own floor. Raw cudarc `sys`/`result` calls on the Context's stream and handles.

use std::ffi::c_void;

use cudarc::cublas::sys as cublas_sys;
use cudarc::cudnn::{result as cudnn_result, sys as cudnn_sys};
use cudarc::driver::sys as drv;
use nnfuse::conv::ConvShape;
use nnfuse::Context;

fn cudnn_err(call: &'static str, e: impl std::fmt::Debug) -> nnfuse::Error {
    nnfuse::Error::NotSupported(format!("{call}: {e:?}"))
}

/// A legacy `cudnnConvolutionForward` of an NHWC f16 problem, descriptors built once
/// (IMPLICIT_PRECOMP_GEMM, tensor-op math, f32 accumulation).
pub struct LegacyConv {
    handle: cudnn_sys::cudnnHandle_t,
    x: cudnn_sys::cudnnTensorDescriptor_t,
    w: cudnn_sys::cudnnFilterDescriptor_t,
    y: cudnn_sys::cudnnTensorDescriptor_t,
    conv: cudnn_sys::cudnnConvolutionDescriptor_t,
    ws: u64,
    ws_bytes: usize,
}

const ALGO: cudnn_sys::cudnnConvolutionFwdAlgo_t =
    cudnn_sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;

impl LegacyConv {
    /// Descriptors of `s` (NHWC, f16) on `ctx`'s cuDNN handle, workspace from the Context.
    pub fn new(ctx: &Context, s: &ConvShape) -> nnfuse::Result<LegacyConv> {
        use cudnn_sys::cudnnDataType_t::{CUDNN_DATA_FLOAT, CUDNN_DATA_HALF};
        use cudnn_sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC;
        let (oh, ow) = s.out_hw()?;
        let i = |v: usize| v as i32;
        let mut g = ctx.lock()?;
        let handle = g.cudnn()?;
        let e = |c| move |err| cudnn_err(c, err);
        // SAFETY: fresh descriptors set once; destroyed in Drop.
        unsafe {
            // An NHWC f16 tensor of logical dims [n, c, h, w].
            let tensor = |dims: [i32; 4]| -> nnfuse::Result<cudnn_sys::cudnnTensorDescriptor_t> {
                let t = cudnn_result::create_tensor_descriptor().map_err(e("create"))?;
                cudnn_result::set_tensor4d_descriptor(t, CUDNN_TENSOR_NHWC, CUDNN_DATA_HALF, dims)
                    .map_err(e("cudnnSetTensor4dDescriptor"))?;
                Ok(t)
            };
            let x = tensor([i(s.n), i(s.c_in), i(s.h), i(s.w)])?;
            let y = tensor([i(s.n), i(s.c_out), i(oh), i(ow)])?;
            let w = cudnn_result::create_filter_descriptor().map_err(e("create"))?;
            cudnn_result::set_filter4d_descriptor(
                w,
                CUDNN_DATA_HALF,
                CUDNN_TENSOR_NHWC,
                [i(s.c_out), i(s.c_in), i(s.kh), i(s.kw)],
            )
            .map_err(e("cudnnSetFilter4dDescriptor"))?;
            let conv = cudnn_result::create_convolution_descriptor().map_err(e("create"))?;
            cudnn_result::set_convolution2d_descriptor(
                conv,
                i(s.pad.0),
                i(s.pad.1),
                i(s.stride.0),
                i(s.stride.1),
                i(s.dilation.0),
                i(s.dilation.1),
                cudnn_sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                CUDNN_DATA_FLOAT,
            )
            .map_err(e("cudnnSetConvolution2dDescriptor"))?;
            cudnn_result::set_convolution_math_type(
                conv,
                cudnn_sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
            )
            .map_err(e("cudnnSetConvolutionMathType"))?;
            let ws_bytes =
                cudnn_result::get_convolution_forward_workspace_size(handle, x, w, conv, y, ALGO)
                    .map_err(e("cudnnGetConvolutionForwardWorkspaceSize"))?;
            let ws = g.workspace(ws_bytes)?;
            Ok(LegacyConv {
                handle,
                x,
                w,
                y,
                conv,
                ws,
                ws_bytes,
            })
        }
    }

    /// One `cudnnConvolutionForward` on raw pointers.
    ///
    /// # Safety
    /// The pointers hold the problem's tensors; one thread; the Context's workspace is not
    /// grown meanwhile.
    pub unsafe fn run(&self, x: u64, w: u64, y: u64) -> nnfuse::Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the caller's contract.
        unsafe {
            cudnn_result::convolution_forward(
                self.handle,
                &alpha as *const f32 as *const c_void,
                self.x,
                x as *const c_void,
                self.w,
                w as *const c_void,
                self.conv,
                ALGO,
                self.ws as *mut c_void,
                self.ws_bytes,
                &beta as *const f32 as *const c_void,
                self.y,
                y as *mut c_void,
            )
        }
        .map_err(|e| cudnn_err("cudnnConvolutionForward", e))
    }
}

impl Drop for LegacyConv {
    fn drop(&mut self) {
        // SAFETY: created once in `new`, destroyed once here.
        unsafe {
            let _ = cudnn_result::destroy_tensor_descriptor(self.x);
            let _ = cudnn_result::destroy_tensor_descriptor(self.y);
            let _ = cudnn_result::destroy_filter_descriptor(self.w);
            let _ = cudnn_result::destroy_convolution_descriptor(self.conv);
        }
    }
}

/// One `cublasGemmStridedBatchedEx` of a packed column-major f16 problem (m, n, k, batch),
/// f32 compute, default algorithm, no transposes.
///
/// # Safety
/// `h` is the Context's cuBLAS handle (bound to its stream); the pointers hold the problem.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_f16(
    h: cublas_sys::cublasHandle_t,
    m: i32,
    n: i32,
    k: i32,
    batch: i32,
    a: u64,
    b: u64,
    c: u64,
) -> nnfuse::Result<()> {
    use cublas_sys::cudaDataType_t::CUDA_R_16F;
    let (alpha, beta) = (1.0f32, 0.0f32);
    // SAFETY: the caller's contract.
    let s = unsafe {
        cublas_sys::cublasGemmStridedBatchedEx(
            h,
            cublas_sys::cublasOperation_t::CUBLAS_OP_N,
            cublas_sys::cublasOperation_t::CUBLAS_OP_N,
            m,
            n,
            k,
            &alpha as *const f32 as *const c_void,
            a as *const c_void,
            CUDA_R_16F,
            m,
            i64::from(m) * i64::from(k),
            b as *const c_void,
            CUDA_R_16F,
            k,
            i64::from(k) * i64::from(n),
            &beta as *const f32 as *const c_void,
            c as *mut c_void,
            CUDA_R_16F,
            m,
            i64::from(m) * i64::from(n),
            batch,
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    if s != cublas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Err(nnfuse::Error::NotSupported(format!(
            "cublasGemmStridedBatchedEx: {s:?}"
        )));
    }
    Ok(())
}

/// One `cuLaunchKernel` of `f` with the kernel parameters `params` (pointers to each argument).
///
/// # Safety
/// `params` match the kernel's signature; the buffers they name hold what the kernel touches.
pub unsafe fn launch(
    ctx: &Context,
    f: drv::CUfunction,
    grid: u32,
    threads: u32,
    params: &mut [*mut c_void],
) -> nnfuse::Result<()> {
    // SAFETY: the caller's contract.
    let r = unsafe {
        drv::cuLaunchKernel(
            f,
            grid,
            1,
            1,
            threads,
            1,
            1,
            0,
            ctx.stream().cu_stream(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    };
    if r != drv::CUresult::CUDA_SUCCESS {
        return Err(nnfuse::Error::NotSupported(format!(
            "cuLaunchKernel: {r:?}"
        )));
    }
    Ok(())
}

/// Sets the release threshold of the device's default memory pool (the pool `cuMemAllocAsync`
/// draws from unless a stream's device has another current pool): 0 = CUDA's default (unused
/// memory is returned to the OS at every synchronisation), `u64::MAX` = keep everything.
pub fn set_default_pool_release_threshold(ctx: &Context, bytes: u64) -> nnfuse::Result<()> {
    let mut dev: drv::CUdevice = 0;
    let mut pool: drv::CUmemoryPool = std::ptr::null_mut();
    let mut v = bytes;
    // SAFETY: plain queries and one attribute set on a live device.
    let r = unsafe {
        ctx.cuda()
            .bind_to_thread()
            .map_err(|e| cudnn_err("cuCtxSetCurrent", e))?;
        let r = drv::cuCtxGetDevice(&mut dev);
        if r != drv::CUresult::CUDA_SUCCESS {
            r
        } else {
            let r = drv::cuDeviceGetDefaultMemPool(&mut pool, dev);
            if r != drv::CUresult::CUDA_SUCCESS {
                r
            } else {
                drv::cuMemPoolSetAttribute(
                    pool,
                    drv::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut v as *mut u64 as *mut c_void,
                )
            }
        }
    };
    if r != drv::CUresult::CUDA_SUCCESS {
        return Err(nnfuse::Error::NotSupported(format!(
            "setting the default pool's release threshold: {r:?}"
        )));
    }
    Ok(())
}
