//! nnfuse's own tensor-core GEMM (`kernels/gemm_tiles.cu`): f16 / bf16 data, f32 accumulation,
//! one rounding per output, deterministic (the configurations that split K add their warps'
//! sums in a fixed order). Any configuration runs when asked for (`Algo::Own`); the search
//! times the one that measured faster than cuBLAS somewhere ([`offered`]: a short K, such as a
//! classifier's weight gradient whose K is the batch).
//!
//! What may run where is pure ([`refusal`], [`offered`]); [`launch`] queues one call.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig};
use once_cell::sync::Lazy;

use super::lt::Ptrs;
use super::problem::{Alignment, Compute, Problem};
use crate::context::Context;
use crate::dtype::DType;
use crate::error::{CallExt, Error, Result};
use crate::kernels::{self, KernelFile};
use crate::launch;

/// The kernel file's configurations (`NNF_GT_CFG`), field for field.
#[derive(Debug, Clone, Copy)]
struct Tiles {
    /// Output tile rows, columns.
    bm: usize,
    bn: usize,
    /// Warps along rows, columns, and K.
    wm: usize,
    wn: usize,
    wk: usize,
    /// cp.async stages.
    stages: usize,
}

impl Tiles {
    const fn threads(&self) -> usize {
        32 * self.wm * self.wn * self.wk
    }
    const fn bk(&self) -> usize {
        32 * self.wk
    }
    /// Dynamic shared memory for operands stored K-contiguous (`ak`, `bk`) or not: the stages,
    /// or the K-split warps' sums, whichever is larger.
    const fn smem_bytes(&self, ak: bool, bk: bool) -> usize {
        let k = self.bk();
        let a = if ak {
            self.bm * (k + 8)
        } else {
            k * (self.bm + 8)
        };
        let b = if bk {
            self.bn * (k + 8)
        } else {
            k * (self.bn + 8)
        };
        let stages = self.stages * (a + b) * 2;
        let acc = (self.bm / self.wm / 16) * (self.bn / self.wn / 8) * 4;
        let sums = (self.wk - 1) * self.wm * self.wn * acc * 32 * 4;
        if stages > sums {
            stages
        } else {
            sums
        }
    }
}

/// Configuration 0: a 32 x 32 tile, its 8 warps splitting K (for few tiles and a long K);
/// 1: 64 x 64, 2 x 2 warps splitting K in two; 2: 128 x 128, 2 x 4 warps (short K); 3: 16 x 32,
/// 8 warps splitting K; 4: 64 x 32, 2 x 4 warps splitting K in four.
const TILES: [Tiles; 5] = [
    Tiles {
        bm: 32,
        bn: 32,
        wm: 1,
        wn: 1,
        wk: 8,
        stages: 5,
    },
    Tiles {
        bm: 64,
        bn: 64,
        wm: 2,
        wn: 2,
        wk: 2,
        stages: 4,
    },
    Tiles {
        bm: 128,
        bn: 128,
        wm: 2,
        wn: 4,
        wk: 1,
        stages: 3,
    },
    Tiles {
        bm: 16,
        bn: 32,
        wm: 1,
        wn: 1,
        wk: 8,
        stages: 7,
    },
    Tiles {
        bm: 64,
        bn: 32,
        wm: 2,
        wn: 1,
        wk: 4,
        stages: 5,
    },
];

/// How many configurations there are (`Algo::Own { config }` takes `0..CONFIGS`).
pub(crate) const CONFIGS: u8 = TILES.len() as u8;

/// A short description of configuration `config` (for labels and reports).
pub(crate) fn describe(config: u8) -> String {
    match TILES.get(config as usize) {
        Some(t) if t.wk > 1 => format!(
            "nnfuse tiles c{config} ({}x{}, K split over {} warps)",
            t.bm, t.bn, t.wk
        ),
        Some(t) => format!("nnfuse tiles c{config} ({}x{})", t.bm, t.bn),
        None => format!("nnfuse tiles c{config} (unknown configuration)"),
    }
}

/// Largest grid.z (the batch).
const MAX_BATCH: usize = 65_535;

/// Why configuration `config` cannot compute `p` on `dtype` data with operands aligned as
/// `align`; `None`: it can. Pure.
pub(crate) fn refusal(p: &Problem, dtype: DType, align: Alignment, config: u8) -> Option<String> {
    let Some(t) = TILES.get(config as usize) else {
        return Some(describe(config));
    };
    if dtype == DType::F32 {
        return Some("nnfuse's tiles kernel takes f16 and bf16 data".into());
    }
    if p.compute != Compute::F32 {
        return Some("nnfuse's tiles kernel accumulates in f32 only".into());
    }
    if [p.m, p.n, p.k, p.lda, p.ldb].iter().any(|v| v % 8 != 0) {
        return Some(format!(
            "m, n, k, lda and ldb must be multiples of 8 (16-byte pieces); got m {} n {} k {} \
             lda {} ldb {}",
            p.m, p.n, p.k, p.lda, p.ldb
        ));
    }
    if align.a < 16 || align.b < 16 {
        return Some(format!(
            "A and B must be 16-byte aligned (pointers and batch strides); they are {} and {} \
             bytes",
            align.a, align.b
        ));
    }
    let tiles = p.m.div_ceil(t.bm).saturating_mul(p.n.div_ceil(t.bn));
    if tiles > i32::MAX as usize
        || p.batch > MAX_BATCH
        || [p.m, p.n, p.k].iter().any(|&v| v > u32::MAX as usize)
    {
        return Some(format!(
            "{tiles} tiles, batch {} or an extent beyond 32 bits: past the kernel's grid",
            p.batch
        ));
    }
    None
}

/// Most K values for the wide-tile configuration to be offered.
const SHORT_K: usize = 128;

/// The configurations worth timing for `p`: the 128 x 128 tile (configuration 2) where K is
/// short (a weight gradient whose K is the batch: the product is its output's write), where it
/// measured up to 10 % faster than cuBLAS on the H100 (f16 2048 x 1000 x 32: 6.75 against
/// 7.4 µs, cold). None elsewhere: the K-splitting configurations (0, 3, 4) lost to cuBLAS on a
/// classifier's forward and data gradient (1.09-1.54x slower, both types) and the 64 x 64 tile
/// on the short-K product (1.23-1.34x), so they run only when asked for. Pure.
pub(crate) fn offered(p: &Problem, dtype: DType, align: Alignment) -> Vec<u8> {
    let mut out = Vec::new();
    if p.k <= SHORT_K {
        out.push(2);
    }
    out.retain(|&c| refusal(p, dtype, align, c).is_none());
    out
}

/// The kernel of data type row `row` (f16, bf16), configuration `config` and transposes
/// `layout` (`nn`, `nt`, `tn`, `tt`: A then B, `t` = transposed): `gemm_tiles_f16_c0_tn`.
fn kernel_name(row: usize, config: u8, layout: usize) -> Option<&'static str> {
    static NAMES: Lazy<Vec<String>> = Lazy::new(|| {
        let mut v = Vec::new();
        for dt in ["f16", "bf16"] {
            for c in 0..CONFIGS {
                for l in ["nn", "nt", "tn", "tt"] {
                    v.push(format!("gemm_tiles_{dt}_c{c}_{l}"));
                }
            }
        }
        v
    });
    if row > 1 || config >= CONFIGS || layout >= 4 {
        return None;
    }
    NAMES
        .get((row * CONFIGS as usize + config as usize) * 4 + layout)
        .map(String::as_str)
}

/// The compilation unit of `dtype`'s configuration `config` for transposes `layout` (`NNF_GT_DT`,
/// `NNF_GT_CFG`, `NNF_GT_L`: one kernel each): a search compiles the kernels it times, not all 24.
fn unit(dtype: DType, config: u8, layout: usize) -> Option<&'static KernelFile> {
    static UNITS: Lazy<Vec<KernelFile>> = Lazy::new(|| {
        let mut v = Vec::with_capacity(8 * CONFIGS as usize);
        for (dt, name) in [(2, "f16"), (3, "bf16")] {
            for c in 0..CONFIGS as u32 {
                for l in 0..4u32 {
                    let defines = [("NNF_GT_DT", dt), ("NNF_GT_CFG", c), ("NNF_GT_L", l)];
                    let label = format!("{name}_c{c}_l{l}");
                    v.push(kernels::unit(&kernels::GEMM_TILES, &label, &defines));
                }
            }
        }
        v
    });
    let row = match dtype {
        DType::F16 => 0,
        DType::BF16 => 1,
        DType::F32 => return None,
    };
    if config >= CONFIGS || layout >= 4 {
        return None;
    }
    UNITS.get((row * CONFIGS as usize + config as usize) * 4 + layout)
}

/// The kernel of `p`'s transposes for `dtype` and `config`, with its shared memory opted in.
pub(crate) fn function(
    ctx: &Context,
    p: &Problem,
    dtype: DType,
    config: u8,
) -> Result<CudaFunction> {
    let no = || Error::NotSupported(describe(config) + ": not for this data type");
    let row = match dtype {
        DType::F16 => 0,
        DType::BF16 => 1,
        DType::F32 => return Err(no()),
    };
    let t = TILES.get(config as usize).ok_or_else(no)?;
    let layout = 2 * usize::from(p.trans_a) + usize::from(p.trans_b);
    let name = kernel_name(row, config, layout).ok_or_else(no)?;
    let file = unit(dtype, config, layout).ok_or_else(no)?;
    let f = ctx.function(file, name)?;
    f.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        t.smem_bytes(p.trans_a, !p.trans_b) as i32,
    )
    .call("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")?;
    Ok(f)
}

/// Whether C can be written in 16-byte pieces: beta == 0 (C is not read) and every column of
/// every matrix starts 16-byte aligned. Pure.
fn vector_stores(p: &Problem, c: u64) -> bool {
    let stride = if p.batch > 1 { p.stride_c } else { 0 };
    p.beta == 0.0 && c % 16 == 0 && p.ldc % 8 == 0 && stride % 8 == 0
}

/// `struct GtArgs` of `kernels/gemm_tiles.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct GtArgs {
    a: u64,
    b: u64,
    c: u64,
    lda: u64,
    ldb: u64,
    ldc: u64,
    sa: u64,
    sb: u64,
    sc: u64,
    m: u32,
    n: u32,
    k: u32,
    tiles_m: u32,
    alpha: f32,
    beta: f32,
    vec: u32,
    pad: u32,
}

// SAFETY: plain-old-data laid out as the kernel's struct (`#[repr(C)]`, size checked below).
unsafe impl DeviceRepr for GtArgs {}

const _: () = assert!(std::mem::size_of::<GtArgs>() == 104);

/// Queues configuration `config` of `p` with kernel `f` (from [`function`] for the same
/// problem, type and configuration).
///
/// # Safety
/// `p` was checked for `dtype` and [`refusal`] passed for it, `config` and the operands'
/// alignment; the pointers hold `p`'s extents on the Context's device and stay valid until the
/// queued work completes; C does not overlap A or B.
pub(crate) unsafe fn launch(
    ctx: &Context,
    f: &CudaFunction,
    p: &Problem,
    config: u8,
    ptrs: Ptrs,
) -> Result<()> {
    let t = TILES
        .get(config as usize)
        .ok_or_else(|| Error::NotSupported(describe(config)))?;
    let tiles_m = p.m.div_ceil(t.bm);
    let tiles = tiles_m * p.n.div_ceil(t.bn);
    if tiles == 0 || p.batch == 0 {
        return Ok(());
    }
    let u = |v: usize| v as u32; // bounded by `refusal`
    let args = GtArgs {
        a: ptrs.a,
        b: ptrs.b,
        c: ptrs.c,
        lda: p.lda as u64,
        ldb: p.ldb as u64,
        ldc: p.ldc as u64,
        sa: p.stride_a as u64,
        sb: p.stride_b as u64,
        sc: p.stride_c as u64,
        m: u(p.m),
        n: u(p.n),
        k: u(p.k),
        tiles_m: u(tiles_m),
        alpha: p.alpha,
        beta: p.beta,
        vec: u32::from(vector_stores(p, ptrs.c)),
        pad: 0,
    };
    let cfg = LaunchConfig {
        grid_dim: (u(tiles), 1, u(p.batch)),
        block_dim: (t.threads() as u32, 1, 1),
        shared_mem_bytes: t.smem_bytes(p.trans_a, !p.trans_b) as u32,
    };
    let mut params = [launch::arg(&args)];
    // SAFETY: the caller's contract; `args` matches the kernel's one parameter.
    unsafe { launch::launch_kernel(ctx, f, cfg, &mut params, "cuLaunchKernel(gemm_tiles)") }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classifier() -> [Problem; 3] {
        [
            Problem::packed_trans(1, 1000, 32, 2048, true, false),
            Problem::packed_trans(1, 2048, 1000, 32, false, true),
            Problem::packed_trans(1, 2048, 32, 1000, false, false),
        ]
    }

    #[test]
    fn only_the_short_k_product_is_offered() {
        let [fwd, wgrad, dgrad] = classifier();
        assert!(offered(&fwd, DType::F16, Alignment::MAX).is_empty());
        assert!(offered(&dgrad, DType::BF16, Alignment::MAX).is_empty());
        assert_eq!(offered(&wgrad, DType::F16, Alignment::MAX), vec![2]);
        assert_eq!(offered(&wgrad, DType::BF16, Alignment::MAX), vec![2]);
        let big = Problem::packed(1, 4096, 4096, 4096);
        assert!(offered(&big, DType::F16, Alignment::MAX).is_empty());
        assert!(offered(&wgrad, DType::F32, Alignment::MAX).is_empty());
    }

    #[test]
    fn refusals_name_what_is_wrong() {
        let [fwd, ..] = classifier();
        let a = Alignment::MAX;
        assert!(refusal(&fwd, DType::F16, a, 0).is_none());
        assert!(refusal(&fwd, DType::F32, a, 0)
            .unwrap()
            .contains("f16 and bf16"));
        let f16c = fwd.with_compute(Compute::F16);
        assert!(refusal(&f16c, DType::F16, a, 0).unwrap().contains("f32"));
        let odd = Problem::packed(1, 1000, 30, 2048);
        assert!(refusal(&odd, DType::F16, a, 1)
            .unwrap()
            .contains("multiples of 8"));
        let mut padded = fwd;
        padded.lda += 4;
        assert!(refusal(&padded, DType::F16, a, 1).unwrap().contains("lda"));
        let low = Alignment { a: 8, b: 256, c: 2 };
        assert!(refusal(&fwd, DType::F16, low, 2)
            .unwrap()
            .contains("16-byte"));
        assert!(refusal(&fwd, DType::F16, a, CONFIGS).is_some());
        let huge = Problem::packed(70_000, 8, 8, 8);
        assert!(refusal(&huge, DType::F16, a, 0).unwrap().contains("grid"));
    }

    /// Each unit compiles to exactly the kernel the launcher asks for under its name (needs
    /// NVRTC; skipped without it; CI has it).
    #[test]
    fn units_compile_to_the_kernels_they_are_asked_for() {
        if !crate::kernels::nvrtc_present() {
            eprintln!("skipping: NVRTC not found");
            return;
        }
        for (row, dt) in [DType::F16, DType::BF16].into_iter().enumerate() {
            for c in 0..CONFIGS {
                for l in 0..4 {
                    let ptx = crate::testutil::ptx_of(unit(dt, c, l).unwrap());
                    let entries = crate::testutil::ptx_entries(&ptx);
                    let want = kernel_name(row, c, l).unwrap();
                    assert_eq!(entries.len(), 1, "{dt} c{c} l{l}: {entries:?}");
                    assert_eq!(entries[0].trim_end_matches('('), want, "{dt} c{c} l{l}");
                }
            }
        }
        assert!(unit(DType::F32, 0, 0).is_none());
        assert!(unit(DType::F16, CONFIGS, 0).is_none());
        assert!(unit(DType::F16, 0, 4).is_none());
    }

    #[test]
    fn shared_memory_fits_every_configuration_and_layout() {
        for t in TILES {
            for (ak, bk) in [(false, false), (false, true), (true, false), (true, true)] {
                let bytes = t.smem_bytes(ak, bk);
                assert!(bytes > 0 && bytes <= 227 * 1024, "{t:?} {ak} {bk}: {bytes}");
            }
        }
    }
}
