//! The folded backward of a pointwise `conv → BatchNorm + add + ReLU` unit
//! (docs/BLOCK-TRAINING.md, "Built: the folded backward of a pointwise unit"): the BatchNorm's input gradient dz, which the
//! composed backward writes (51 MB in the demo's last unit) and both convolution gradients read
//! again, is never written, and z is not read at all. With g = dy through the ReLU's mask (the
//! shortcut's gradient, which the caller needs anyway) and z the 1x1 convolution of x, every
//! output follows from g, x and small matrices (`kernels/bn_fold.cu` has the algebra):
//!
//! 1. `fold_sums`: g written, per-channel sums of g and of x (one pass over dy, the mask, x);
//! 2. G = gᵀx and H = xᵀx (f32): G is the filter gradient of g. For f16 and bf16 with 64 input
//!    channels and output channels a multiple of 256 the sums pass makes them on tensor cores
//!    (`fold_gram`, then `fold_gram_finish` adds the blocks' partials): neither g nor x is read
//!    again; otherwise two cuBLAS products;
//! 3. `fold_finalize`: dgamma and dbeta (Σ g (z − M) from G and w, no pass over z), the
//!    BatchNorm's apply coefficients, a ⊙ w and [C ⊙ w | the constant of dz] (after
//!    `fold_gram`, the last blocks of `fold_gram_finish` do this, one launch fewer);
//! 4. `fold_dw`: dw = a ⊙ G + C ⊙ (w H − M sᵀ) − a b ⊗ s, and in blocks of its own
//!    [MM | bias] = wᵀ [C ⊙ w | constant]: MM = wᵀ diag(C) w and the bias;
//! 5. dx = g · (a ⊙ w) through the convolution's own data gradient, then x · MM + bias added
//!    in place (cuBLASLt, bias epilogue).
//!
//! What the backward keeps from the forward: x, the saved statistics and the ReLU's bitmask (z
//! only for the caller's other uses). Launchers on operands the caller ([`super::ConvBnTrain`])
//! validated; no decisions here.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr};

use super::api::lock;
use super::lt_epilogue::{EpilogueGemm, GemmPtrs, OPERAND_ALIGNMENT};
use super::plan::GemmGeometry;
use crate::batchnorm::{BnSaved, OwnParts};
use crate::context::Context;
use crate::conv::{Conv2d, ConvShape};
use crate::dtype::{DType, Element};
use crate::error::{CallExt, Error, Result};
use crate::gemm::WORKSPACE_BYTES;
use crate::kernels;
use crate::launch;
use cudarc::driver::LaunchConfig;

/// `struct FoldDwArgs` of `kernels/bn_fold.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct FoldDwArgs {
    coef: u64,
    w: u64,
    h: u64,
    s: u64,
    gmat: u64,
    dw: u64,
    wc: u64,
    mm: u64,
    k: u32,
    cin: u32,
}

/// `struct FoldSumsArgs` of `kernels/bn_fold.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct FoldSumsArgs {
    dy: u64,
    mask: u64,
    g: u64,
    x: u64,
    part: u64,
    rows: u64,
    rpb: u64,
    k: u32,
    cin: u32,
}

/// `struct FoldFinalizeArgs` of `kernels/bn_fold.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct FoldFinalizeArgs {
    part: u64,
    gmat: u64,
    w: u64,
    mean: u64,
    mean_lo: u64,
    inv_std: u64,
    gamma: u64,
    dgamma: u64,
    dbeta: u64,
    coef: u64,
    s: u64,
    wa: u64,
    wc: u64,
    blocks: u32,
    k: u32,
    cin: u32,
    inv_count: f32,
}

/// `struct FoldGramArgs` of `kernels/bn_fold.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct FoldGramArgs {
    dy: u64,
    mask: u64,
    g: u64,
    x: u64,
    part: u64,
    gram: u64,
    rows: u64,
    rpb: u64,
    k: u32,
}

/// `struct FoldGramReduceArgs` of `kernels/bn_fold.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct FoldGramReduceArgs {
    gram: u64,
    seg: u64,
    counters: u64,
    gmat: u64,
    h: u64,
    blocks: u32,
    k: u32,
    cin: u32,
}

/// `struct FoldGramFinishArgs` of `kernels/bn_fold.cu`: the reduction's part, then the
/// finalize's.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct FoldGramFinishArgs {
    r: FoldGramReduceArgs,
    f: FoldFinalizeArgs,
}

// SAFETY: plain `repr(C)` structs of integers (and one f32), passed by value as kernel
// parameters.
unsafe impl DeviceRepr for FoldDwArgs {}
// SAFETY: as above.
unsafe impl DeviceRepr for FoldGramArgs {}
// SAFETY: as above.
unsafe impl DeviceRepr for FoldGramFinishArgs {}
// SAFETY: as above.
unsafe impl DeviceRepr for FoldSumsArgs {}
// SAFETY: as above.
unsafe impl DeviceRepr for FoldFinalizeArgs {}

/// The folded backward's own buffers (made once per unit; the bias's address is fixed in the
/// cuBLASLt descriptor).
struct Bufs<T> {
    /// `fold_sums`' partial sums, `[blocks][K + Cin]`.
    part: CudaSlice<f32>,
    /// G = gᵀx, column-major `K x Cin`, f32.
    gmat: CudaSlice<f32>,
    /// The BatchNorm's `[5][K]` coefficients.
    coef: CudaSlice<f32>,
    /// x's per-channel sums, f32.
    sums: CudaSlice<f32>,
    /// `H = xᵀx`, f32.
    gram: CudaSlice<f32>,
    /// `a ⊙ w`, KRSC like w.
    wa: CudaSlice<T>,
    /// `[C ⊙ w | the constant of dz]`, column-major `K x (Cin + 1)`.
    wc: CudaSlice<T>,
    /// `[MM | bias] = wᵀ wc`, column-major `Cin x (Cin + 1)` (MM is symmetric; the bias is its
    /// last column).
    mm: CudaSlice<T>,
    /// Where the sums pass makes G and H: its blocks' partials `[blocks][K·Cin + Cin²]`, the
    /// reduction's segments `[GRAM_SEG][K·Cin + Cin²]` and its per-chunk arrival counters.
    tc: Option<GramBufs>,
}

/// The buffers of `fold_gram` and `fold_gram_finish`.
struct GramBufs {
    part: CudaSlice<f32>,
    seg: CudaSlice<f32>,
    counters: CudaSlice<u32>,
}

/// The operands of one folded backward, validated by the caller: lengths as the unit's shape
/// says, every output disjoint from every input.
pub(crate) struct FoldOperands<'s, T> {
    pub x: CudaView<'s, T>,
    pub w: CudaView<'s, T>,
    pub z: CudaView<'s, T>,
    pub dy: CudaView<'s, T>,
    pub gamma: CudaView<'s, f32>,
    pub saved: &'s BnSaved,
    pub dx: Option<CudaViewMut<'s, T>>,
    pub accumulate_dx: bool,
    pub dw: CudaViewMut<'s, T>,
    pub dgamma: CudaViewMut<'s, f32>,
    pub dbeta: CudaViewMut<'s, f32>,
    pub d_addend: CudaViewMut<'s, T>,
}

/// The folded backward of one unit.
pub(crate) struct FoldBackward<T> {
    ctx: Context,
    /// Rows of x (N·H·W), output channels K, input channels Cin.
    rows: usize,
    k: usize,
    cin: usize,
    /// `fold_sums`' (or `fold_gram`'s) blocks over the rows.
    blocks: usize,
    /// Rows per block.
    rpb: usize,
    /// Whether the sums pass makes G and H ([`gram_in_sums`]).
    gram: bool,
    bufs: Mutex<Bufs<T>>,
    gemm: Mutex<Option<std::result::Result<Arc<EpilogueGemm>, String>>>,
    /// Whether `fold_gram`'s dynamic shared memory limit is raised (`GRAM_SMEM_BYTES`).
    gram_smem_set: AtomicBool,
}

impl<T: Element> FoldBackward<T> {
    /// The buffers of `shape`'s unit (a pointwise NHWC convolution, checked by the plan).
    pub(crate) fn new(ctx: &Context, shape: &ConvShape) -> Result<FoldBackward<T>> {
        let s = ctx.stream();
        let (k, cin) = (shape.c_out, shape.c_in);
        let rows = shape.n * shape.h * shape.w;
        let f32s = |len: usize| s.alloc_zeros::<f32>(len.max(1)).call("cuMemAllocAsync");
        let ts = |len: usize| s.alloc_zeros::<T>(len.max(1)).call("cuMemAllocAsync");
        let gram = gram_in_sums(T::DTYPE, k, cin);
        let (blocks, rpb) = row_blocks(rows, launch::sm_count(ctx) as usize, gram.then_some(k));
        let total = k * cin + cin * cin;
        let gram_bufs = if gram {
            Some(GramBufs {
                part: f32s(blocks * total)?,
                seg: f32s(GRAM_SEG * total)?,
                counters: s
                    .alloc_zeros::<u32>(reduce_chunks(total))
                    .call("cuMemAllocAsync")?,
            })
        } else {
            None
        };
        Ok(FoldBackward {
            ctx: ctx.clone(),
            rows,
            k,
            cin,
            blocks,
            rpb,
            gram,
            bufs: Mutex::new(Bufs {
                part: f32s(blocks * (k + cin))?,
                gmat: f32s(k * cin)?,
                coef: f32s(5 * k)?,
                sums: f32s(cin)?,
                gram: f32s(cin * cin)?,
                wa: ts(k * cin)?,
                wc: ts(k * (cin + 1))?,
                mm: ts(cin * (cin + 1))?,
                tc: gram_bufs,
            }),
            gemm: Mutex::new(None),
            gram_smem_set: AtomicBool::new(false),
        })
    }

    /// Where G and H are made (`ConvBnTrain::fold_products`).
    pub(crate) fn products_route(&self) -> &'static str {
        if self.gram {
            "sums pass (tensor cores)"
        } else {
            "cuBLAS"
        }
    }

    /// Why these operands cannot fold (16-byte vectors of dy, g and x; w an operand of a
    /// cuBLASLt product assuming 16-byte alignment), or None.
    pub(crate) fn refusal(&self, [dy, g, x, w]: [u64; 4]) -> Option<String> {
        let v = 16 / T::DTYPE.size();
        if self.k % v != 0 || self.cin % v != 0 || self.k / v > FOLD_THREADS {
            return Some(format!(
                "its kernels read 16-byte vectors: channels must be multiples of {v}, at most \
                 {} output channels ({} and {} here)",
                v * FOLD_THREADS,
                self.cin,
                self.k
            ));
        }
        if [dy, g, x, w].iter().any(|p| p % 16 != 0) {
            return Some("dy, d_addend, x or w is not 16-byte aligned".into());
        }
        None
    }

    /// The backward on `o` (see the module documentation).
    pub(crate) fn run(&self, conv: &Conv2d<T>, o: FoldOperands<'_, T>) -> Result<()> {
        let st = self.ctx.stream().clone();
        let Some(parts) = o.saved.own_parts() else {
            return Err(Error::invalid(
                "saved",
                "the folded backward needs the own path's state with its ReLU bitmask",
            ));
        };
        let (zp, _gz) = o.z.device_ptr(&st);
        if zp != parts.x || parts.mask_words < (self.rows * self.k).div_ceil(32) {
            return Err(Error::invalid(
                "saved",
                "does not belong to this z (its input or its bitmask differ)",
            ));
        }
        let mut b = lock(&self.bufs);
        let (xp, _gx) = o.x.device_ptr(&st);
        let (dyp, _gdy) = o.dy.device_ptr(&st);
        let (wp, _gw) = o.w.device_ptr(&st);
        let (gp, _gg) = o.d_addend.device_ptr(&st);
        let (gammap, _gga) = o.gamma.device_ptr(&st);
        let mut dgamma = o.dgamma;
        let mut dbeta = o.dbeta;
        let (dgp, _gdg) = dgamma.device_ptr_mut(&st);
        let (dbp, _gdb) = dbeta.device_ptr_mut(&st);
        let fin = self.finalize_args(&mut b, wp, &parts, [gammap, dgp, dbp])?;
        if self.gram {
            self.sums_gram(&mut b, dyp, parts.mask, gp, xp, fin)?;
        } else {
            self.sums(&mut b, dyp, parts.mask, gp, xp)?;
            self.gemms(&mut b, gp, xp)?;
            let warps = (self.k + self.cin) as u64;
            self.launch("fold_finalize", launch_warps(warps), &fin)?;
        }
        let mut dw = o.dw;
        self.finish_dw(&mut b, wp, &mut dw)?;
        let g = o.d_addend.slice(..);
        if let Some(mut dx) = o.dx {
            conv.backward_data_into(&g, &b.wa.as_view(), &mut dx, o.accumulate_dx)?;
            self.add_projection(&b, &o.x, &mut dx)?;
        }
        Ok(())
    }

    /// `fold_sums`: g written, the blocks' partial sums of g and x.
    fn sums(&self, b: &mut Bufs<T>, dy: u64, mask: u64, g: u64, x: u64) -> Result<()> {
        let s = self.ctx.stream();
        let args = FoldSumsArgs {
            dy,
            mask,
            g,
            x,
            part: b.part.device_ptr_mut(s).0,
            rows: self.rows as u64,
            rpb: self.rpb as u64,
            k: dim(self.k, "c_out")?,
            cin: dim(self.cin, "c_in")?,
        };
        self.launch("fold_sums", blocks(self.blocks, FOLD_THREADS), &args)
    }

    /// `fold_gram` then `fold_gram_finish`: g written, the sums of g and x, G and H, then
    /// `fin`'s work (the finalize) by the reduction's last blocks.
    fn sums_gram(
        &self,
        b: &mut Bufs<T>,
        dy: u64,
        mask: u64,
        g: u64,
        x: u64,
        fin: FoldFinalizeArgs,
    ) -> Result<()> {
        let s = self.ctx.stream();
        let (gmat, h) = (b.gmat.device_ptr_mut(s).0, b.gram.device_ptr_mut(s).0);
        let part = b.part.device_ptr_mut(s).0;
        let Some(gb) = b.tc.as_mut() else {
            return Err(Error::NotSupported(
                "the folded backward's tensor-core buffers are missing".into(),
            ));
        };
        let args = FoldGramArgs {
            dy,
            mask,
            g,
            x,
            part,
            gram: gb.part.device_ptr_mut(s).0,
            rows: self.rows as u64,
            rpb: self.rpb as u64,
            k: dim(self.k, "c_out")?,
        };
        let cfg = LaunchConfig {
            grid_dim: (
                dim(self.blocks, "blocks")?,
                dim(self.k / GRAM_KS, "c_out")?,
                1,
            ),
            block_dim: (GRAM_THREADS as u32, 1, 1),
            shared_mem_bytes: GRAM_SMEM_BYTES as u32,
        };
        if !self.gram_smem_set.load(Ordering::Acquire) {
            // Once per unit: the attribute stays with the function (a call each time cost host time).
            let f = self
                .ctx
                .function(&kernels::BN_FOLD, kernel_name("fold_gram", T::DTYPE))?;
            launch::allow_dynamic_smem(&f, GRAM_SMEM_BYTES)?;
            self.gram_smem_set.store(true, Ordering::Release);
        }
        self.launch("fold_gram", cfg, &args)?;
        let total = self.k * self.cin + self.cin * self.cin;
        let r = FoldGramReduceArgs {
            gram: gb.part.device_ptr(s).0,
            seg: gb.seg.device_ptr_mut(s).0,
            counters: gb.counters.device_ptr_mut(s).0,
            gmat,
            h,
            blocks: dim(self.blocks, "blocks")?,
            k: dim(self.k, "c_out")?,
            cin: dim(self.cin, "c_in")?,
        };
        let args = FoldGramFinishArgs { r, f: fin };
        let cfg = LaunchConfig {
            grid_dim: (dim(reduce_chunks(total), "chunks")?, GRAM_SEG as u32, 1),
            block_dim: (GRAM_REDUCE_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch("fold_gram_finish", cfg, &args)
    }

    /// G = gᵀx and H = xᵀx (cublasGemmEx, f32 results). Through the cached cuBLASLt product
    /// (`lt_product.rs`, the heuristic's first algorithm) the bf16 filter gradient of the demo's
    /// unit differed from the composed one by 1.0e-2 in one run (2.6e-3 this way): kept on
    /// cuBLAS's own choice until that is understood.
    fn gemms(&self, b: &mut Bufs<T>, g: u64, x: u64) -> Result<()> {
        let s = self.ctx.stream();
        let (k, n) = (dim(self.k, "c_out")? as i32, dim(self.cin, "c_in")? as i32);
        let rows = dim(self.rows, "rows")? as i32;
        let products = [
            (k, g, b.gmat.device_ptr_mut(s).0, "G"),
            (n, x, b.gram.device_ptr_mut(s).0, "the Gram matrix"),
        ];
        let mut guard = self.ctx.lock()?;
        let h = guard.cublas()?;
        for (m, a, out, what) in products {
            // SAFETY: `a` holds rows·m values (column-major m x rows, ld m: g or x), x rows·Cin;
            // `out` m·Cin f32, this object's; the handle is bound to the Context's stream.
            unsafe { gram_f32(h, [m, n, rows], a, x, out, T::DTYPE) }
                .map_err(|e| Error::NotSupported(format!("{what}: {e}")))?;
        }
        Ok(())
    }

    /// The finalize's arguments (dgamma, dbeta, the coefficients and x's sums; run by
    /// `fold_finalize`, or by `fold_gram_finish` where the sums pass makes G).
    fn finalize_args(
        &self,
        b: &mut Bufs<T>,
        w: u64,
        parts: &OwnParts,
        [gamma, dgamma, dbeta]: [u64; 3],
    ) -> Result<FoldFinalizeArgs> {
        let s = self.ctx.stream();
        Ok(FoldFinalizeArgs {
            part: b.part.device_ptr(s).0,
            gmat: b.gmat.device_ptr(s).0,
            w,
            mean: parts.mean,
            mean_lo: parts.mean_lo,
            inv_std: parts.inv_std,
            gamma,
            dgamma,
            dbeta,
            coef: b.coef.device_ptr_mut(s).0,
            s: b.sums.device_ptr_mut(s).0,
            wa: b.wa.device_ptr_mut(s).0,
            wc: b.wc.device_ptr_mut(s).0,
            blocks: dim(self.blocks, "blocks")?,
            k: dim(self.k, "c_out")?,
            cin: dim(self.cin, "c_in")?,
            inv_count: (1.0 / self.rows as f64) as f32,
        })
    }

    /// Queues `<base>_<t>` of `kernels/bn_fold.cu` with its one argument struct.
    fn launch<A: DeviceRepr>(&self, base: &str, cfg: LaunchConfig, args: &A) -> Result<()> {
        let name = kernel_name(base, T::DTYPE);
        let f = self.ctx.function(&kernels::BN_FOLD, name)?;
        // SAFETY: every pointer in `args` holds the extents its kernel reads or writes: the
        // caller's operands validated by ConvBnTrain (lengths from the unit's shape), the rest
        // this object's own buffers sized in `new`.
        unsafe { launch::launch_kernel(&self.ctx, &f, cfg, &mut [launch::arg(args)], name) }
    }

    /// dx += x · MM + bias (cuBLASLt, in place: C and D are dx with one layout).
    fn add_projection(
        &self,
        b: &Bufs<T>,
        x: &CudaView<'_, T>,
        dx: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        let s = self.ctx.stream();
        let (xp, _gx) = x.device_ptr(s);
        let (dp, _gd) = dx.device_ptr_mut(s);
        let p = GemmPtrs {
            a: b.mm.device_ptr(s).0,
            b: xp,
            c: dp,
            d: dp,
        };
        if [p.a, p.b, p.d].iter().any(|v| v % OPERAND_ALIGNMENT != 0) {
            return Err(Error::NotSupported(format!(
                "x or dx is not {OPERAND_ALIGNMENT}-byte aligned (the folded backward's matmul \
                 assumes it)"
            )));
        }
        let mut g = self.ctx.lock()?;
        let h = g.cublaslt()?;
        let gemm = self.gemm_for(h, b)?;
        let ws = g.workspace(WORKSPACE_BYTES)?;
        let cu = s.cu_stream() as lt_sys::cudaStream_t;
        // SAFETY: x and dx validated by the caller (dx disjoint from x), aligned as checked; MM
        // and the bias are this object's; cuBLASLt multiplies in place when C and D share one
        // pointer and one layout (cublasLtMatmul's reference); the workspace holds
        // WORKSPACE_BYTES while the guard lives.
        unsafe { gemm.run(None, h, p, 1.0, ws, WORKSPACE_BYTES, cu) }
    }

    /// The matmul's descriptors, made on first use (a failure is kept).
    fn gemm_for(&self, h: lt_sys::cublasLtHandle_t, b: &Bufs<T>) -> Result<Arc<EpilogueGemm>> {
        let mut slot = lock(&self.gemm);
        if slot.is_none() {
            let geometry = GemmGeometry {
                m: self.cin,
                n: self.rows,
                k: self.cin,
                pointwise: true,
                columns: 0,
            };
            // The bias is [MM | bias]'s last column.
            let bias = b.mm.device_ptr(self.ctx.stream()).0
                + (self.cin * self.cin * T::DTYPE.size()) as u64;
            *slot = Some(
                EpilogueGemm::new(h, &geometry, T::DTYPE, false, bias)
                    .map(Arc::new)
                    .map_err(|e| e.to_string()),
            );
        }
        match &*slot {
            Some(Ok(g)) => Ok(g.clone()),
            Some(Err(why)) => Err(Error::NotSupported(why.clone())),
            None => Err(Error::NotSupported(
                "the folded backward's matmul is missing".into(),
            )),
        }
    }

    /// `fold_dw`: dw from G, H and the sums, and in blocks of its own
    /// `[MM | bias] = wᵀ [C ⊙ w | constant]` (for the data gradient's projection).
    fn finish_dw(&self, b: &mut Bufs<T>, w: u64, dw: &mut CudaViewMut<'_, T>) -> Result<()> {
        let s = self.ctx.stream();
        let (dwp, _gd) = dw.device_ptr_mut(s);
        let args = FoldDwArgs {
            coef: b.coef.device_ptr(s).0,
            w,
            h: b.gram.device_ptr(s).0,
            s: b.sums.device_ptr(s).0,
            gmat: b.gmat.device_ptr(s).0,
            dw: dwp,
            wc: b.wc.device_ptr(s).0,
            mm: b.mm.device_ptr_mut(s).0,
            k: dim(self.k, "c_out")?,
            cin: dim(self.cin, "c_in")?,
        };
        let grid = self.k + self.cin + 1; // dw's rows, then [MM | bias]'s columns
        self.launch("fold_dw", blocks(grid, self.cin.div_ceil(32) * 32), &args)
    }
}

use cudarc::cublas::sys as cublas_sys;

/// `C = A · Bᵀ` in f32 (column-major: A `m x k` ld m, B `n x k` ld n, C `m x n` ld m) from
/// `dtype` operands, `CUBLAS_COMPUTE_32F`, cuBLAS's default algorithm.
///
/// # Safety
/// Live handle bound to the stream of the operands' work; the pointers hold the extents.
unsafe fn gram_f32(
    h: cublas_sys::cublasHandle_t,
    [m, n, k]: [i32; 3],
    a: u64,
    b: u64,
    c: u64,
    dtype: DType,
) -> Result<()> {
    let (alpha, beta) = (1.0f32, 0.0f32);
    let t = dtype.cuda();
    cublas_sys::cublasGemmEx(
        h,
        cublas_sys::cublasOperation_t::CUBLAS_OP_N,
        cublas_sys::cublasOperation_t::CUBLAS_OP_T,
        m,
        n,
        k,
        &alpha as *const f32 as *const std::ffi::c_void,
        a as *const std::ffi::c_void,
        t,
        m,
        b as *const std::ffi::c_void,
        t,
        n,
        &beta as *const f32 as *const std::ffi::c_void,
        c as *mut std::ffi::c_void,
        cublas_sys::cudaDataType::CUDA_R_32F,
        m,
        cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
    )
    .result()
    .call("cublasGemmEx")
}

/// Threads of a `fold_sums` block (`FOLD_THREADS` of `kernels/bn_fold.cu`).
const FOLD_THREADS: usize = 256;
/// `fold_gram`'s threads, output channels per block and input channels (`GRAM_*`).
const GRAM_THREADS: usize = 256;
const GRAM_KS: usize = 128;
const GRAM_CIN: usize = 64;
/// Rows of one `fold_gram` tile.
const GRAM_R: usize = 64;
/// `fold_gram`'s stages of copies in flight and its dynamic shared memory (two blocks fit an
/// SM of 228 KiB).
const GRAM_STAGES: usize = 3;
const GRAM_SMEM_BYTES: usize = {
    let (v, t) = (8, 2); // 16-bit elements: 8 to a 16-byte vector
    let passes = GRAM_R / (GRAM_THREADS / (GRAM_KS / v)); // mask words a thread copies
    let stage = GRAM_R * GRAM_KS * t + GRAM_R * (GRAM_CIN + 8) * t + passes * GRAM_THREADS * 4;
    GRAM_STAGES * stage + GRAM_R * (GRAM_KS + 8) * t
};
/// `fold_gram_finish`'s segments over the blocks and threads per block.
const GRAM_SEG: usize = 16;
const GRAM_REDUCE_THREADS: usize = 256;

/// Whether the sums pass makes G and H on tensor cores (`fold_gram`): f16 or bf16 (mma.sync
/// has no f32 inputs at f32's accuracy), 64 input channels and output channels a multiple of
/// 256 (slabs of 128 channels, at least two, so that each block's share of G and H fits its
/// registers).
pub(crate) fn gram_in_sums(dtype: DType, k: usize, cin: usize) -> bool {
    dtype != DType::F32 && cin == GRAM_CIN && k % (2 * GRAM_KS) == 0 && k > 0 && k <= FOLD_MAX_K
}

/// Blocks over the rows and rows per block: about two blocks per SM in all (`gram`: the output
/// channels, split in slabs of 128 that are blocks of their own; rows per block a multiple of a
/// tile), each at least 64 rows.
fn row_blocks(rows: usize, sms: usize, gram: Option<usize>) -> (usize, usize) {
    let slabs = gram.map_or(1, |k| (k / GRAM_KS).max(1));
    let want = (2 * sms / slabs).max(1).min(rows.div_ceil(64)).max(1);
    let mut rpb = rows.div_ceil(want).max(1);
    if gram.is_some() {
        rpb = rpb.div_ceil(GRAM_R) * GRAM_R;
    }
    (rows.div_ceil(rpb).max(1), rpb)
}

/// `fold_gram_finish`'s chunks: 4 outputs a thread.
fn reduce_chunks(total: usize) -> usize {
    total.div_ceil(4 * GRAM_REDUCE_THREADS).max(1)
}
/// Most input channels the kernels take (a thread per channel in one block).
pub(crate) const FOLD_MAX_CIN: usize = 256;
/// Most output channels the kernels take (`FOLD_MAX_K`: three f32 arrays in shared memory).
pub(crate) const FOLD_MAX_K: usize = 2048;

/// `n` blocks of `threads` threads.
fn blocks(n: usize, threads: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A warp per item, 128 threads a block.
fn launch_warps(warps: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((warps * 32).div_ceil(128).max(1) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `n` as the kernels' u32, or an error naming `what`.
fn dim(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::invalid(what, format!("{n} exceeds u32")))
}

/// `<base>_<t>` of `kernels/bn_fold.cu`.
fn kernel_name(base: &str, dtype: DType) -> &'static str {
    match (base, dtype) {
        ("fold_gram_finish", DType::BF16) => return "fold_gram_finish_bf16",
        ("fold_gram_finish", _) => return "fold_gram_finish_f16",
        ("fold_gram", DType::BF16) => return "fold_gram_bf16",
        ("fold_gram", _) => return "fold_gram_f16", // f32 never makes G in the sums pass
        _ => {}
    }
    const NAMES: [[&str; 3]; 3] = [
        ["fold_sums_f32", "fold_sums_f16", "fold_sums_bf16"],
        [
            "fold_finalize_f32",
            "fold_finalize_f16",
            "fold_finalize_bf16",
        ],
        ["fold_dw_f32", "fold_dw_f16", "fold_dw_bf16"],
    ];
    let row = match base {
        "fold_sums" => 0,
        "fold_finalize" => 1,
        _ => 2, // fold_dw
    };
    let col = match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
    };
    NAMES[row][col]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_core_sums_where_their_tiles_fit() {
        assert!(gram_in_sums(DType::F16, 256, 64));
        assert!(gram_in_sums(DType::BF16, 2048, 64));
        assert!(!gram_in_sums(DType::F32, 256, 64), "f32");
        assert!(!gram_in_sums(DType::F16, 256, 32), "Cin 32");
        assert!(
            !gram_in_sums(DType::F16, 384, 64),
            "K not a multiple of 256"
        );
        assert!(!gram_in_sums(DType::F16, 128, 64), "one slab");
        assert!(
            !gram_in_sums(DType::F16, 4096, 64),
            "K past the fold's limit"
        );
    }

    #[test]
    fn row_blocks_cover_the_rows_in_whole_tiles() {
        // The demo's last unit on an H100: 2 slabs, 131 blocks of 768 rows.
        assert_eq!(row_blocks(100_352, 132, Some(256)), (131, 768));
        assert_eq!(row_blocks(100_352, 132, None), (264, 381));
        for (rows, sms, k) in [
            (784, 132, Some(256)),
            (1, 132, Some(256)),
            (5000, 7, Some(2048)),
        ] {
            let (b, rpb) = row_blocks(rows, sms, k);
            assert_eq!(rpb % GRAM_R, 0, "{rows}");
            assert!(
                b * rpb >= rows && (b - 1) * rpb < rows,
                "{rows}: {b} x {rpb}"
            );
        }
    }

    #[test]
    fn argument_structs_match_the_kernel() {
        let src = kernels::BN_FOLD.source;
        for (name, size, want) in [
            (
                "FoldDwArgs",
                std::mem::size_of::<FoldDwArgs>(),
                8 * 8 + 2 * 4,
            ),
            (
                "FoldSumsArgs",
                std::mem::size_of::<FoldSumsArgs>(),
                7 * 8 + 2 * 4,
            ),
            (
                "FoldFinalizeArgs",
                std::mem::size_of::<FoldFinalizeArgs>(),
                13 * 8 + 4 * 4,
            ),
            (
                "FoldGramArgs",
                std::mem::size_of::<FoldGramArgs>(),
                8 * 8 + 8,
            ),
            (
                "FoldGramReduceArgs",
                std::mem::size_of::<FoldGramReduceArgs>(),
                5 * 8 + 3 * 4 + 4,
            ),
            (
                "FoldGramFinishArgs",
                std::mem::size_of::<FoldGramFinishArgs>(),
                (5 * 8 + 3 * 4 + 4) + (13 * 8 + 4 * 4),
            ),
        ] {
            assert!(src.contains(&format!("struct {name} {{")), "{name}");
            assert_eq!(size, want, "{name}");
        }
        assert!(src.contains(&format!("#define FOLD_THREADS {FOLD_THREADS}\n")));
        assert!(src.contains(&format!("#define FOLD_MAX_K {FOLD_MAX_K}\n")));
        assert!(src.contains(&format!("float wk[{FOLD_MAX_CIN}]")));
        assert!(src.contains(&format!("#define FOLD_MAX_CIN {FOLD_MAX_CIN}\n")));
        for (name, v) in [
            ("GRAM_THREADS", GRAM_THREADS),
            ("GRAM_KS", GRAM_KS),
            ("GRAM_CIN", GRAM_CIN),
            ("GRAM_R", GRAM_R),
            ("GRAM_SEG", GRAM_SEG),
            ("GRAM_REDUCE_THREADS", GRAM_REDUCE_THREADS),
            ("GRAM_STAGES", GRAM_STAGES),
            ("GRAM_SMEM_BYTES", GRAM_SMEM_BYTES),
        ] {
            assert!(src.contains(&format!("#define {name} {v}\n")), "{name}");
        }
        for n in [
            "fold_gram_f16",
            "fold_gram_bf16",
            "fold_gram_finish_f16",
            "fold_gram_finish_bf16",
        ] {
            assert!(src.contains(&format!(") {n}(")), "{n}");
        }
        for t in [DType::F32, DType::F16, DType::BF16] {
            for base in ["fold_sums", "fold_finalize", "fold_dw"] {
                let n = kernel_name(base, t);
                assert!(n.starts_with(base), "{n}");
                assert!(src.contains(&format!(") {n}(")), "{n}");
            }
        }
    }
}
