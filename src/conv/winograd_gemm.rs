//! The Direct batched multiply (`kernels/winograd_gemm.cu`): the seed's non-tensor-core engine
//! for Winograd's batched GEMM — plain shared-memory tiles, f32 accumulation, any sizes.
//!
//! It computes exactly what [`crate::gemm::strided_batched`] computes for the same
//! [`Problem`] (column-major, all four transpose combinations, leading dimensions, batch
//! strides, a stride of 0 for A or B broadcasting, alpha and beta with beta = 0 not reading C),
//! and validates it the same way ([`Problem::check`] and [`crate::gemm::check_pointers`]):
//! dimensions within cuBLAS's `int` limits, leading dimensions, C's batches not overlapping,
//! C not overlapping A or B, pointers aligned to the element size. The one difference:
//! [`crate::gemm::Compute::F16`] is accepted for f16 data but accumulated in f32 (more accurate
//! than asked, never less).

use cudarc::driver::LaunchConfig;

use super::winograd::launch::{direct_grid, direct_kernel, direct_unit, DIRECT_THREADS};
use crate::context::Context;
use crate::dtype::DType;
use crate::error::Result;
use crate::gemm::{check_pointers, Problem, Validated};

/// Runs `p` (column-major, as [`crate::gemm::strided_batched`]; alpha/beta honoured) with the
/// Direct kernel.
///
/// # Safety
/// `a`, `b`, `c` hold the problem's extents of `dtype` elements on `ctx`'s device (checked by the
/// caller), `c` disjoint from `a` and `b`.
pub(crate) unsafe fn batched_direct(
    ctx: &Context,
    p: &Problem,
    dtype: DType,
    a: u64,
    b: u64,
    c: u64,
) -> Result<()> {
    let spans = match p.check(dtype)? {
        Validated::Empty => return Ok(()),
        Validated::Spans(s) => s,
    };
    check_pointers(&spans, dtype.size(), a, b, c)?;
    let ((gx, gy), mblocks) = direct_grid(p.m, p.n, p.batch)?;
    let name = direct_kernel(dtype, p.trans_a, p.trans_b);
    let f = ctx.function(direct_unit(dtype), name)?;
    tracing::debug!(
        kernel = name,
        m = p.m,
        n = p.n,
        k = p.k,
        batch = p.batch,
        grid = ?(gx, gy),
        "Direct batched multiply"
    );
    // Problem::check bounds m, n, k and batch by i32::MAX.
    let (m, n, k, batch) = (p.m as u32, p.n as u32, p.k as u32, p.batch as u32);
    let (lda, ldb, ldc) = (p.lda as u64, p.ldb as u64, p.ldc as u64);
    let (sa, sb, sc) = (p.stride_a as u64, p.stride_b as u64, p.stride_c as u64);
    use crate::launch::arg;
    let mut params = [
        arg(&a),
        arg(&b),
        arg(&c),
        arg(&m),
        arg(&n),
        arg(&k),
        arg(&lda),
        arg(&ldb),
        arg(&ldc),
        arg(&sa),
        arg(&sb),
        arg(&sc),
        arg(&batch),
        arg(&p.alpha),
        arg(&p.beta),
        arg(&mblocks),
    ];
    let cfg = LaunchConfig {
        grid_dim: (gx, gy, 1),
        block_dim: (DIRECT_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let call = "cuLaunchKernel(winograd_gemm_direct)";
    // SAFETY: the arguments match winograd_gemm_direct_* (a, b, c, m, n, k, lda, ldb, ldc, sa,
    // sb, sc, batch, alpha, beta, mblocks); the problem was checked and the caller guarantees
    // the extents; C does not overlap A or B (checked) nor itself across batches (checked).
    unsafe { crate::launch::launch_kernel(ctx, &f, cfg, &mut params, call) }
}

#[cfg(test)]
mod gpu_tests {
    use super::*;
    use crate::gemm::Compute;
    use crate::reference::gemm::gemm_strided_batched;
    use crate::testutil::{gpu, rel_l2, Rng};
    use crate::Element;
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    use half::{bf16, f16};

    use crate::testutil::exact_values as exact;

    /// One problem on one type: C poisoned with NaN when beta = 0 (it must not be read), with
    /// values otherwise; compared with the f64 reference on the whole C.
    fn check<T: Element>(ctx: &Context, p: &Problem, a: &[f64], b: &[f64], c0: &[f64]) -> f64 {
        let s = ctx.stream();
        let to = |v: &[f64]| v.iter().map(|x| T::from_f64(*x)).collect::<Vec<T>>();
        let da = s.clone_htod(&to(a)).unwrap();
        let db = s.clone_htod(&to(b)).unwrap();
        let mut dc = s.clone_htod(&to(c0)).unwrap();
        if p.beta == 0.0 {
            crate::util::fill(ctx, &mut dc, T::from_f64(f64::NAN)).unwrap();
        }
        {
            let (pa, _ga) = da.device_ptr(s);
            let (pb, _gb) = db.device_ptr(s);
            let (pc, _gc) = dc.device_ptr_mut(s);
            // SAFETY: the buffers hold the problem's extents (made from its spans below).
            unsafe { batched_direct(ctx, p, T::DTYPE, pa, pb, pc) }.unwrap();
        }
        let got: Vec<f64> = s
            .clone_dtoh(&dc)
            .unwrap()
            .iter()
            .map(|v| v.to_f64())
            .collect();
        let mut want = c0.to_vec();
        gemm_strided_batched(&p.to_reference(), a, b, &mut want).unwrap();
        // Elements C's matrices do not cover keep their old value (NaN when poisoned).
        let covered = |e: usize| {
            let (bt, r) = (e / p.stride_c.max(1), e % p.stride_c.max(1));
            bt < p.batch && r % p.ldc < p.m && r / p.ldc < p.n
        };
        let (mut g2, mut w2) = (Vec::new(), Vec::new());
        for (e, (g, w)) in got.iter().zip(&want).enumerate() {
            if covered(e) {
                assert!(g.is_finite(), "{p:?} {}: element {e} is {g}", T::DTYPE);
                g2.push(*g);
                w2.push(*w);
            }
        }
        let err = rel_l2(&g2, &w2);
        let tol = crate::gemm::tolerance(T::DTYPE, Compute::F32, p.k);
        assert!(
            err <= tol,
            "{} {p:?}: relative L2 error {err:.3e} > {tol:.1e}",
            T::DTYPE
        );
        err
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn direct_matches_the_reference() {
        let ctx = gpu();
        let mut rng = Rng::fresh("direct_matches_the_reference");
        let mut ran = 0;
        // Odd sizes, sizes below and above the 64x64x16 tile, every transpose, padded leading
        // dimensions, padded strides, broadcast B, alpha/beta.
        for (m, n, k, batch) in [
            (1, 1, 1, 1),
            (7, 5, 3, 2),
            (64, 64, 16, 1),
            (65, 63, 17, 3),
            (130, 33, 129, 2),
            (30, 200, 64, 36),
        ] {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                for (alpha, beta, pad, broadcast_b) in [
                    (1.0f32, 0.0f32, 0, false),
                    (0.5, -1.5, 3, false),
                    (-2.0, 1.0, 1, true),
                ] {
                    let mut p =
                        Problem::packed_trans(batch, m, n, k, ta, tb).with_scalars(alpha, beta);
                    p.lda += pad;
                    p.ldb += 2 * pad;
                    p.ldc += pad;
                    let (ar, ac) = p.a_dims();
                    let (br, bc) = p.b_dims();
                    p.stride_a = p.lda * ac + pad;
                    p.stride_b = if broadcast_b { 0 } else { p.ldb * bc + 5 * pad };
                    p.stride_c = p.ldc * n + pad;
                    let la = (batch - 1) * p.stride_a + (ac - 1) * p.lda + ar;
                    let lb = (batch - 1) * p.stride_b + (bc - 1) * p.ldb + br;
                    let lc = (batch - 1) * p.stride_c + (n - 1) * p.ldc + m;
                    let a = exact(&mut rng, la);
                    let b = exact(&mut rng, lb);
                    let c0 = exact(&mut rng, lc);
                    let e32 = check::<f32>(&ctx, &p, &a, &b, &c0);
                    let e16 = check::<f16>(&ctx, &p, &a, &b, &c0);
                    let eb = check::<bf16>(&ctx, &p, &a, &b, &c0);
                    eprintln!(
                        "m {m} n {n} k {k} batch {batch} ta {ta} tb {tb} alpha {alpha} beta \
                         {beta}: f32 {e32:.1e} f16 {e16:.1e} bf16 {eb:.1e}"
                    );
                    ran += 1;
                }
            }
        }
        assert_eq!(ran, 6 * 4 * 3);
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn direct_validates_like_gemm() {
        let ctx = gpu();
        let s = ctx.stream();
        let buf = s.alloc_zeros::<f32>(1024).unwrap();
        let (p0, _g) = buf.device_ptr(s);
        let p = Problem::packed(2, 8, 8, 8);
        // C overlapping A.
        // SAFETY: rejected before any launch.
        let e = unsafe { batched_direct(&ctx, &p, DType::F32, p0, p0 + 4096, p0 + 64) };
        assert_eq!(e.unwrap_err().argument(), Some("c"));
        // Two batches writing the same C.
        let mut q = p;
        q.stride_c = 0;
        // SAFETY: rejected before any launch.
        let e = unsafe { batched_direct(&ctx, &q, DType::F32, p0, p0 + 1024, p0 + 2048) };
        assert_eq!(e.unwrap_err().argument(), Some("stride_c"));
        // ldc below m.
        let mut q = p;
        q.ldc = 4;
        // SAFETY: rejected before any launch.
        let e = unsafe { batched_direct(&ctx, &q, DType::F32, p0, p0 + 1024, p0 + 2048) };
        assert_eq!(e.unwrap_err().argument(), Some("ldc"));
        // Empty: nothing to do.
        let q = Problem::packed(0, 8, 8, 8);
        // SAFETY: empty, nothing launched.
        unsafe { batched_direct(&ctx, &q, DType::F32, p0, p0 + 1024, p0 + 2048) }.unwrap();
    }
}
