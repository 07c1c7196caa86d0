//! The run functions of the `stem_filter` and `stem_forward` paths: nnfuse's tensor-core kernels
//! for f16 / bf16 channels-last layers with few input channels (`kernels/conv_stem.cu`;
//! ResNet's 7x7/2 stem). The filter gradient's first kernel writes one partial filter gradient
//! (f32) per range of output row segments into the Context's scratch; the second adds them in a
//! fixed order into dw (overwriting it, or adding to it for an accumulating call), rounding
//! once. The forward writes y directly. Sizes and refusals are `problem::stem`'s, which the
//! plans' rules apply too.

use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig};
use once_cell::sync::Lazy;

use super::call::PathCall;
use super::plan::Direction;
use super::problem::{
    stem_filter_refusal, stem_forward_grid, stem_forward_refusal, stem_grid, ConvShape, StemGrid,
};
use crate::context::Context;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::{self, KernelFile};
use crate::launch;

/// Threads per block of both kernels.
const THREADS: u32 = 256;
/// Elements of dw one reduce block writes (`stem_reduce`: 32 elements x 8 split groups).
const REDUCE_ELEMS: usize = 32;

/// `struct StemGeom` of `kernels/conv_stem.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct StemGeom {
    n: u32,
    h: u32,
    w: u32,
    c: u32,
    k: u32,
    oh: u32,
    ow: u32,
    kh: u32,
    kw: u32,
    sh: u32,
    sw: u32,
    ph: i32,
    pw: i32,
    r: u32,
    segs: u32,
    units: u32,
    splits: u32,
    xsw: u32,
    pieces: u32,
    ldw: u32,
}

// SAFETY: plain-old-data, laid out as the kernel's struct (`#[repr(C)]`, size checked below).
unsafe impl DeviceRepr for StemGeom {}

/// The kernels' geometry. Every extent was bounded by the path's refusal (`problem::stem`:
/// 32-bit indices), so the narrowing casts are exact.
fn geometry(s: &ConvShape, (oh, ow): (usize, usize), g: &StemGrid) -> StemGeom {
    let u = |v: usize| v as u32;
    StemGeom {
        n: u(s.n),
        h: u(s.h),
        w: u(s.w),
        c: u(s.c_in),
        k: u(s.c_out),
        oh: u(oh),
        ow: u(ow),
        kh: u(s.kh),
        kw: u(s.kw),
        sh: u(s.stride.0),
        sw: u(s.stride.1),
        ph: s.pad.0 as i32,
        pw: s.pad.1 as i32,
        r: u(g.columns),
        segs: u(g.segs),
        units: u(g.units),
        splits: u(g.splits),
        xsw: u(g.xsw),
        pieces: u(g.pieces),
        ldw: u(g.ldw),
    }
}

/// The main kernel of each column-tile count (`NT` = 1 to 5), f16 then bf16.
const MAIN: [[&str; 5]; 2] = [
    [
        "conv_stem_wgrad_f16_n1",
        "conv_stem_wgrad_f16_n2",
        "conv_stem_wgrad_f16_n3",
        "conv_stem_wgrad_f16_n4",
        "conv_stem_wgrad_f16_n5",
    ],
    [
        "conv_stem_wgrad_bf16_n1",
        "conv_stem_wgrad_bf16_n2",
        "conv_stem_wgrad_bf16_n3",
        "conv_stem_wgrad_bf16_n4",
        "conv_stem_wgrad_bf16_n5",
    ],
];

/// The kernels' names for `dtype` (f16 or bf16) and `nt` column tiles (1 to 5).
fn kernel_names(dtype: DType, nt: usize) -> Result<(&'static str, &'static str)> {
    let (row, reduce) = match dtype {
        DType::F16 => (0, "conv_stem_wgrad_reduce_f16"),
        DType::BF16 => (1, "conv_stem_wgrad_reduce_bf16"),
        DType::F32 => return Err(Error::NotSupported("stem_filter: f16 and bf16 only".into())),
    };
    let main = nt
        .checked_sub(1)
        .and_then(|i| MAIN[row].get(i))
        .ok_or_else(|| Error::NotSupported(format!("stem_filter: {nt} column tiles (1 to 5)")))?;
    Ok((main, reduce))
}

/// The unit number of the forward kernel (`NNF_SW_NT = 6`); 1 to 5 are the filter gradient's
/// column-tile counts.
pub(crate) const FORWARD_UNIT: usize = 6;

/// The compilation unit of `dtype`'s filter-gradient kernel with `nt` column tiles, or of its
/// forward kernel for `nt` = [`FORWARD_UNIT`] (`NNF_SW_DT`, `NNF_SW_NT`): a first call compiles
/// that kernel (and the type's reduce), not all fourteen. None for f32 or another `nt`.
pub(crate) fn unit(dtype: DType, nt: usize) -> Option<&'static KernelFile> {
    static UNITS: Lazy<Vec<KernelFile>> = Lazy::new(|| {
        let mut v = Vec::with_capacity(12);
        for (dt, name) in [(2, "f16"), (3, "bf16")] {
            for nt in 1..=FORWARD_UNIT as u32 {
                let label = format!("{name}_n{nt}");
                let defines = [("NNF_SW_DT", dt), ("NNF_SW_NT", nt)];
                v.push(kernels::unit(&kernels::CONV_STEM, &label, &defines));
            }
        }
        v
    });
    let row = match dtype {
        DType::F16 => 0,
        DType::BF16 => 1,
        DType::F32 => return None,
    };
    (1..=FORWARD_UNIT)
        .contains(&nt)
        .then(|| &UNITS[row * FORWARD_UNIT + nt - 1])
}

/// Refuses an operand `path`'s kernel cannot move: x in 4-byte pieces, the pixel rows of
/// `rows` (dy for the filter gradient, y for the forward) in 16-byte ones.
fn check_alignment(path: &str, x: u64, rows: (&str, u64)) -> Result<()> {
    for (name, ptr, bytes) in [("x", x, 4u64), (rows.0, rows.1, 16)] {
        if ptr % bytes != 0 {
            return Err(Error::NotSupported(format!(
                "{path}: {name} at {ptr:#x} is not {bytes}-byte aligned (the kernel moves it \
                 in {bytes}-byte pieces)"
            )));
        }
    }
    Ok(())
}

/// Kernel `name` of `file` with its dynamic shared memory allowed, and its launch: one block per
/// unit range and filter tile of `grid`.
fn main_kernel(
    ctx: &Context,
    file: &'static KernelFile,
    name: &'static str,
    grid: &StemGrid,
) -> Result<(CudaFunction, LaunchConfig)> {
    let f = ctx.function(file, name)?;
    launch::allow_dynamic_smem(&f, grid.smem_bytes)?;
    let cfg = LaunchConfig {
        grid_dim: (grid.splits as u32, grid.k_tiles as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: grid.smem_bytes as u32,
    };
    Ok((f, cfg))
}

/// Runs a `stem_filter` route (registered in `paths.rs`).
///
/// # Safety
/// As [`super::route::run`].
pub(crate) unsafe fn raw_run(c: &PathCall<'_>) -> Result<()> {
    let t = c.target;
    if c.direction != Direction::BackwardFilter {
        return Err(c.no_direction("nnfuse's tensor-core filter-gradient kernel"));
    }
    let s = t.shape;
    let out_hw = s.out_hw()?;
    let cap = t.ctx.config().conv_workspace_bytes();
    if let Some(why) = stem_filter_refusal(s, t.dtype, out_hw, cap) {
        return Err(Error::NotSupported(why));
    }
    let p = c.bwd_filter();
    check_alignment("stem_filter", p.x, ("dy", p.dy))?;
    let grid = stem_grid(s, out_hw, cap);
    let geom = geometry(s, out_hw, &grid);
    let (main, reduce) = kernel_names(t.dtype, grid.nt)?;
    let file = unit(t.dtype, grid.nt)
        .ok_or_else(|| Error::NotSupported("stem_filter: no kernel for this type".into()))?;
    let scratch = t.ctx.scratch(grid.scratch_bytes(s))?;
    let part = scratch.ptr();
    let (f, cfg) = main_kernel(t.ctx, file, main, &grid)?;
    tracing::debug!(kernel = main, shape = ?s, grid = ?cfg.grid_dim, "stem filter-gradient kernel");
    let mut params = [
        launch::arg(&p.x),
        launch::arg(&p.dy),
        launch::arg(&part),
        launch::arg(&geom),
    ];
    // SAFETY: (const u16*, const u16*, float*, StemGeom) is the kernel's signature; x and dy
    // hold the problem's extents (the caller's contract), the scratch one partial filter
    // gradient per split (`scratch_bytes`).
    unsafe {
        launch::launch_kernel(
            t.ctx,
            &f,
            cfg,
            &mut params,
            "cuLaunchKernel(conv_stem_wgrad)",
        )?
    };
    let elems = s.c_out * grid.columns;
    let f = t.ctx.function(file, reduce)?;
    let (n_elems, splits, accumulate) = (elems as u32, geom.splits, u32::from(c.accumulate));
    let mut params = [
        launch::arg(&part),
        launch::arg(&p.dw),
        launch::arg(&n_elems),
        launch::arg(&splits),
        launch::arg(&accumulate),
    ];
    let cfg = LaunchConfig {
        grid_dim: (elems.div_ceil(REDUCE_ELEMS) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: (const float*, T*, u32 x3) is the kernel's signature; dw holds the filter's
    // elements (the caller's contract, KRSC = [k][kh*kw*c]), the scratch the partial sums
    // written above, in stream order. The scratch guard is held until both launches are queued.
    let r = unsafe {
        launch::launch_kernel(
            t.ctx,
            &f,
            cfg,
            &mut params,
            "cuLaunchKernel(conv_stem_wgrad_reduce)",
        )
    };
    drop(scratch);
    r
}

/// Runs a `stem_forward` route (registered in `paths.rs`).
///
/// # Safety
/// As [`super::route::run`].
pub(crate) unsafe fn raw_run_forward(c: &PathCall<'_>) -> Result<()> {
    let t = c.target;
    if c.direction != Direction::Forward {
        return Err(c.no_direction("nnfuse's tensor-core stem forward kernel"));
    }
    let s = t.shape;
    let out_hw = s.out_hw()?;
    if let Some(why) = stem_forward_refusal(s, t.dtype, out_hw) {
        return Err(Error::NotSupported(why));
    }
    let p = c.fwd();
    check_alignment("stem_forward", p.x, ("y", p.y))?;
    let grid = stem_forward_grid(s, out_hw);
    let geom = geometry(s, out_hw, &grid);
    let name = match t.dtype {
        DType::F16 => "conv_stem_fwd_f16",
        DType::BF16 => "conv_stem_fwd_bf16",
        DType::F32 => {
            return Err(Error::NotSupported(
                "stem_forward: f16 and bf16 only".into(),
            ))
        }
    };
    let file = unit(t.dtype, FORWARD_UNIT)
        .ok_or_else(|| Error::NotSupported("stem_forward: no kernel for this type".into()))?;
    let (f, cfg) = main_kernel(t.ctx, file, name, &grid)?;
    tracing::debug!(kernel = name, shape = ?s, grid = ?cfg.grid_dim, "stem forward kernel");
    let mut params = [
        launch::arg(&p.x),
        launch::arg(&p.w),
        launch::arg(&p.y),
        launch::arg(&geom),
    ];
    // SAFETY: (const u16*, const u16*, u16*, StemGeom) is the kernel's signature; x, w and y
    // hold the problem's extents (the caller's contract).
    unsafe { launch::launch_kernel(t.ctx, &f, cfg, &mut params, "cuLaunchKernel(conv_stem_fwd)") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_struct_matches_the_kernel() {
        // kernels/conv_stem.cu: static_assert(sizeof(StemGeom) == 80).
        assert_eq!(std::mem::size_of::<StemGeom>(), 80);
    }

    #[test]
    fn misaligned_operands_are_refused_by_name() {
        assert!(check_alignment("stem_filter", 0x1000, ("dy", 0x2000)).is_ok());
        let e = check_alignment("stem_filter", 0x1002, ("dy", 0x2000))
            .unwrap_err()
            .to_string();
        assert!(e.contains("x at 0x1002") && e.contains("4-byte"), "{e}");
        let e = check_alignment("stem_filter", 0x1000, ("dy", 0x2008))
            .unwrap_err()
            .to_string();
        assert!(e.contains("dy at 0x2008") && e.contains("16-byte"), "{e}");
        let e = check_alignment("stem_forward", 0x1000, ("y", 0x2004))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("not supported: stem_forward: y at 0x2004")
                || e.contains("stem_forward: y at 0x2004"),
            "{e}"
        );
    }

    #[test]
    fn every_kernel_name_is_in_the_compiled_file() {
        if !crate::kernels::nvrtc_present() {
            eprintln!("skipping: NVRTC not found");
            return;
        }
        let image = crate::kernels::compile(&kernels::CONV_STEM, "compute_90").unwrap();
        let ptx = String::from_utf8_lossy(image.bytes()).into_owned();
        for dtype in [DType::F16, DType::BF16] {
            for nt in 1..=5 {
                let (main, reduce) = kernel_names(dtype, nt).unwrap();
                for k in [main, reduce] {
                    assert!(ptx.contains(&format!(".entry {k}(")), "{k} missing");
                }
            }
        }
        assert!(kernel_names(DType::F32, 1).is_err());
        assert!(kernel_names(DType::F16, 0).is_err() && kernel_names(DType::F16, 6).is_err());
        // Each unit holds its own kernel and its type's reduce, and no other main kernel.
        let image = crate::kernels::compile(unit(DType::BF16, 3).unwrap(), "compute_90").unwrap();
        let ptx = String::from_utf8_lossy(image.bytes()).into_owned();
        assert_eq!(
            ptx.matches(".entry ").count(),
            2,
            "{}",
            unit(DType::BF16, 3).unwrap().name
        );
        assert!(
            ptx.contains(".entry conv_stem_wgrad_bf16_n3(")
                && ptx.contains(".entry conv_stem_wgrad_reduce_bf16(")
        );
        assert!(unit(DType::F32, 1).is_none() && unit(DType::F16, 7).is_none());
        let image =
            crate::kernels::compile(unit(DType::F16, FORWARD_UNIT).unwrap(), "compute_90").unwrap();
        let ptx = String::from_utf8_lossy(image.bytes()).into_owned();
        assert!(ptx.contains(".entry conv_stem_fwd_f16("), "forward unit");
        assert!(
            !ptx.contains(".entry conv_stem_wgrad_f16_n"),
            "forward unit holds no filter-gradient kernel"
        );
    }
}
