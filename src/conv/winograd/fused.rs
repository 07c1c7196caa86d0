//! The fused Winograd engine (`kernels/winograd_fused.cu`): one kernel computes the input
//! transform, the per-position products on tensor cores and the output transform, so the
//! transformed input U and the product M stay on the SM (shared memory and registers). This file
//! holds its pure launch arithmetic (mirrors of the kernel's constants, grid, compilation units;
//! tested on the CPU) and the launcher.
//!
//! The kernel reads x (NHWC) and the transformed filter `V[pos][c_in][c_out]` made by the
//! ordinary filter transform (so a prepared filter serves every engine) and writes y; the design
//! and its fragment layouts are documented at the top of the kernel file and in
//! `docs/WINOGRAD.md` ("The fused engine").

use cudarc::driver::LaunchConfig;

use crate::context::Context;
use crate::conv::problem::{fused_eligible, WinogradGeometry, WinogradTile};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::KernelFile;

/// Threads per block (`WF_THREADS`): 8 warps.
pub(crate) const THREADS: u32 = 256;
/// Warps along the tiles and along the output channels (`WF_WARPS_T`, `WF_WARPS_K`).
pub(crate) const WARPS: (usize, usize) = (2, 4);
/// Tiles per block (`WF_TT`): 16 per warp row.
pub(crate) const TILES_PER_BLOCK: usize = 32;
/// Input channels per step of the kernel's loop (`WF_KC`): the MMA's k.
pub(crate) const CHANNEL_CHUNK: usize = 16;
/// Bytes of the kernel's static shared memory (the tile table: an 8-byte image offset and two
/// 4-byte origins per tile).
pub(crate) const STATIC_SMEM: usize = TILES_PER_BLOCK * 16;
/// Most tiles one launch covers: the kernel indexes tiles in `u32` (`blockIdx.x * 32 + 31` must
/// not wrap); larger batches run in several launches of whole images.
pub(crate) const MAX_LAUNCH_TILES: usize = 1 << 30;

/// The kernel's per-tile constants (`WfCfg<M>`), in elements of the 16-bit type unless named
/// bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cfg {
    /// `m + 2`.
    pub alpha: usize,
    /// `alpha²` transform positions.
    pub positions: usize,
    /// m16n8 fragments per warp along the output channels.
    pub nf: usize,
    /// Output channels per block.
    pub tk: usize,
    /// Row of the raw-input stage (one tile: `positions * 16` channels plus a 16-byte pad).
    pub xrow: usize,
    /// Row of a V stage (one (position, channel): `tk` output channels plus a 16-byte pad).
    pub vrow: usize,
    /// Elements of the raw-input stage.
    pub xs: usize,
    /// Elements of U.
    pub us: usize,
    /// Elements of one V stage (there are two).
    pub vs: usize,
    /// Dynamic shared memory in bytes.
    pub smem_bytes: usize,
}

/// [`Cfg`] of `tile`.
pub(crate) const fn cfg(tile: WinogradTile) -> Cfg {
    let alpha = tile.alpha();
    let positions = alpha * alpha;
    let nf = match tile {
        WinogradTile::F2x3 => 2,
        WinogradTile::F4x3 => 1,
    };
    let tk = 8 * nf * WARPS.1;
    let xrow = positions * CHANNEL_CHUNK + 8;
    let vrow = tk + 8;
    let xs = TILES_PER_BLOCK * xrow;
    let us = positions * 2 * TILES_PER_BLOCK * 8;
    let vs = positions * CHANNEL_CHUNK * vrow;
    Cfg {
        alpha,
        positions,
        nf,
        tk,
        xrow,
        vrow,
        xs,
        us,
        vs,
        smem_bytes: (xs + us + 2 * vs) * 2,
    }
}

/// The kernel of `(dtype, tile)`, `None` for f32.
pub(crate) fn kernel(dtype: DType, tile: WinogradTile) -> Option<&'static str> {
    Some(match (dtype, tile) {
        (DType::F16, WinogradTile::F2x3) => "winograd_fused_f2x3_f16",
        (DType::F16, WinogradTile::F4x3) => "winograd_fused_f4x3_f16",
        (DType::BF16, WinogradTile::F2x3) => "winograd_fused_f2x3_bf16",
        (DType::BF16, WinogradTile::F4x3) => "winograd_fused_f4x3_bf16",
        (DType::F32, _) => return None,
    })
}

/// The fragment-layout probe of `dtype` (one warp, one MMA), `None` for f32 (GPU unit tests).
#[cfg(test)]
pub(crate) fn probe_kernel(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F16 => Some("winograd_fused_mma_probe_f16"),
        DType::BF16 => Some("winograd_fused_mma_probe_bf16"),
        DType::F32 => None,
    }
}

macro_rules! wf_unit {
    ($label:literal, $dt:literal, $tile:literal) => {
        KernelFile {
            name: concat!("winograd_fused.cu[", $label, "]"),
            source: concat!(
                include_str!("../../../kernels/prelude.cuh"),
                "\n#define NNF_WF_DT ",
                $dt,
                "\n#define NNF_WF_TILE ",
                $tile,
                "\n#line 1 \"winograd_fused.cu\"\n",
                include_str!("../../../kernels/winograd_fused.cu")
            ),
        }
    };
}

/// Compilation units: `(dtype, tile)` → the unit holding [`kernel`]; tile `None` → the probe.
static UNITS: [(DType, Option<WinogradTile>, KernelFile); 6] = [
    (
        DType::F16,
        Some(WinogradTile::F2x3),
        wf_unit!("f16,f2x3", 2, 2),
    ),
    (
        DType::F16,
        Some(WinogradTile::F4x3),
        wf_unit!("f16,f4x3", 2, 4),
    ),
    (
        DType::BF16,
        Some(WinogradTile::F2x3),
        wf_unit!("bf16,f2x3", 3, 2),
    ),
    (
        DType::BF16,
        Some(WinogradTile::F4x3),
        wf_unit!("bf16,f4x3", 3, 4),
    ),
    (DType::F16, None, wf_unit!("f16,probe", 2, 1)),
    (DType::BF16, None, wf_unit!("bf16,probe", 3, 1)),
];

/// The compilation unit of [`kernel`] (`tile` given) or of [`probe_kernel`] (`None`).
pub(crate) fn unit(dtype: DType, tile: Option<WinogradTile>) -> Option<&'static KernelFile> {
    UNITS
        .iter()
        .find(|u| u.0 == dtype && u.1 == tile)
        .map(|u| &u.2)
}

fn too_big(what: &str) -> Error {
    Error::invalid(
        "shape",
        format!("{what} exceeds what the fused Winograd kernel can index"),
    )
}

/// Grid of one launch over `tiles` tiles and `c_out` output channels:
/// `(ceil(tiles / 32), ceil(c_out / tk))`.
pub(crate) fn grid(tiles: usize, c_out: usize, tile: WinogradTile) -> Result<(u32, u32)> {
    if tiles > MAX_LAUNCH_TILES {
        return Err(too_big("the tiles of one launch"));
    }
    let y = c_out.div_ceil(cfg(tile).tk);
    if y > 65_535 {
        return Err(too_big("c_out"));
    }
    Ok((tiles.div_ceil(TILES_PER_BLOCK) as u32, y as u32))
}

/// Images per launch: balanced chunks of the batch of at most [`MAX_LAUNCH_TILES`] tiles each
/// (one chunk for any batch nnfuse meets in practice).
pub(crate) fn launches(n: usize, tiles_per_image: usize) -> Result<Vec<usize>> {
    let per = MAX_LAUNCH_TILES / tiles_per_image.max(1);
    if per == 0 {
        return Err(too_big("the tiles of one image"));
    }
    Ok(crate::conv::sizes::balanced_chunks(n, per))
}

/// Everything [`forward`] checks before it launches, except the transformed filter's pointer:
/// the type and channel counts ([`fused_eligible`]), x 16-byte and y 4-byte aligned, a device of
/// sm_80+ with enough shared memory per block (else `Error::NotSupported`), sizes within the
/// kernel's 32-bit indexing. The path calls it before its filter transform, so that a refusal
/// launches nothing.
pub(crate) fn check(
    ctx: &Context,
    g: &WinogradGeometry,
    dtype: DType,
    x: u64,
    y: u64,
) -> Result<()> {
    let (s, tile, d) = (&g.problem, g.tile, &g.dims);
    fused_eligible(s, dtype).map_err(|why| Error::invalid("shape", why))?;
    for (name, ptr, align) in [("x", x, 16u64), ("y", y, 4)] {
        aligned(name, ptr, align)?;
    }
    let cc = ctx.info().compute_capability;
    if cc < (8, 0) {
        return Err(Error::NotSupported(format!(
            "the fused Winograd engine needs mma.sync and cp.async (sm_80+); this device is sm_{}{}",
            cc.0, cc.1
        )));
    }
    let need = cfg(tile).smem_bytes + STATIC_SMEM;
    let optin = crate::launch::device_facts(ctx)?.smem_optin;
    if (optin as usize) < need {
        return Err(Error::NotSupported(format!(
            "the fused Winograd {} kernel needs {need} bytes of shared memory per block; this \
             device allows {optin}",
            tile.name()
        )));
    }
    let (oh, ow) = s.out_hw()?;
    // The kernel forms tap rows and columns as i32 (origin minus padding plus alpha).
    for extent in [oh + s.pad.0, ow + s.pad.1, s.h, s.w] {
        if extent > (i32::MAX as usize) / 2 {
            return Err(too_big("the padded image"));
        }
    }
    for (v, what) in [
        (s.h, "h"),
        (s.w, "w"),
        (s.c_in, "c_in"),
        (s.c_out, "c_out"),
        (s.pad.0.max(s.pad.1), "pad"),
        (oh, "oh"),
        (ow, "ow"),
        (d.tiles_h, "tiles_h"),
        (d.tiles_w, "tiles_w"),
    ] {
        super::launch::arg_u32(v, what)?;
    }
    for images in launches(s.n, d.tiles_per_image)? {
        grid(images * d.tiles_per_image, s.c_out, tile)?;
    }
    Ok(())
}

fn aligned(name: &'static str, ptr: u64, align: u64) -> Result<()> {
    if ptr == 0 || ptr % align != 0 {
        return Err(Error::invalid(
            name,
            format!(
                "device pointer {ptr:#x}: the fused Winograd kernel needs {align}-byte alignment"
            ),
        ));
    }
    Ok(())
}

/// Queues the fused forward of Winograd problem `s` (already checked eligible for the
/// Winograd path): x (NHWC) and the transformed filter `v` (`V[pos][c_in][c_out]`) → y. Refuses
/// as [`check`] does, and a `v` not 16-byte aligned, before any launch.
///
/// # Safety
/// `x` holds `s.x_len()`, `v` `winograd_dims(s, tile).v` and `y` `s.y_len()` elements of `dtype`
/// on `ctx`'s device; y is disjoint from both.
pub(crate) unsafe fn forward(
    ctx: &Context,
    g: &WinogradGeometry,
    dtype: DType,
    x: u64,
    v: u64,
    y: u64,
) -> Result<()> {
    check(ctx, g, dtype, x, y)?;
    aligned("v", v, 16)?;
    let (s, tile, d) = (&g.problem, g.tile, &g.dims);
    let c = cfg(tile);
    let (oh, ow) = s.out_hw()?;
    let u = |v: usize, what: &str| super::launch::arg_u32(v, what);
    let (h32, w32, c32, k32) = (
        u(s.h, "h")?,
        u(s.w, "w")?,
        u(s.c_in, "c_in")?,
        u(s.c_out, "c_out")?,
    );
    let (ph, pw) = (u(s.pad.0, "pad")?, u(s.pad.1, "pad")?);
    let (oh32, ow32) = (u(oh, "oh")?, u(ow, "ow")?);
    let (th32, tw32) = (u(d.tiles_h, "tiles_h")?, u(d.tiles_w, "tiles_w")?);
    let chunks = launches(s.n, d.tiles_per_image)?;
    let name = kernel(dtype, tile)
        .ok_or_else(|| Error::invalid("dtype", "the fused engine runs f16 and bf16"))?;
    let file = unit(dtype, Some(tile))
        .ok_or_else(|| Error::NotSupported(format!("no compilation unit holds {name}")))?;
    let f = ctx.function(file, name)?;
    crate::launch::allow_dynamic_smem(&f, c.smem_bytes)?;
    let elem = dtype.size() as u64;
    let x_image = (s.h * s.w * s.c_in) as u64 * elem;
    let y_image = (oh * ow * s.c_out) as u64 * elem;
    let mut first = 0u64;
    for images in chunks {
        let tiles = images * d.tiles_per_image;
        let (gx, gy) = grid(tiles, s.c_out, tile)?;
        let tiles32 = tiles as u32; // <= MAX_LAUNCH_TILES
        tracing::debug!(
            kernel = name,
            images,
            tiles,
            grid = ?(gx, gy),
            smem = c.smem_bytes,
            "Winograd fused forward"
        );
        let (xc, yc) = (x + first * x_image, y + first * y_image);
        use crate::launch::arg;
        let mut params = [
            arg(&xc),
            arg(&v),
            arg(&yc),
            arg(&h32),
            arg(&w32),
            arg(&c32),
            arg(&k32),
            arg(&ph),
            arg(&pw),
            arg(&oh32),
            arg(&ow32),
            arg(&th32),
            arg(&tw32),
            arg(&tiles32),
        ];
        let lc = LaunchConfig {
            grid_dim: (gx, gy, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: c.smem_bytes as u32,
        };
        // SAFETY: the arguments match winograd_fused_* (x, v, y, h, w, c, k, pad_h, pad_w, oh,
        // ow, tiles_h, tiles_w, tiles); the caller guarantees the extents; channel counts are
        // multiples of 8 and the pointers aligned (checked), so every 16-byte piece the kernel
        // copies is in range or zero-filled; the dynamic shared memory was opted in above.
        unsafe {
            crate::launch::launch_kernel(ctx, &f, lc, &mut params, "cuLaunchKernel(winograd_fused)")
        }?;
        first += images as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The constants mirror `WfCfg<M>` in the kernel source (parsed from it).
    #[test]
    fn constants_match_the_kernel_source() {
        let src = include_str!("../../../kernels/winograd_fused.cu");
        let define = |name: &str| -> usize {
            let line = src
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("{name} not defined"));
            line.split_whitespace().nth(2).unwrap().parse().unwrap()
        };
        assert_eq!(define("WF_THREADS"), THREADS as usize);
        assert_eq!(define("WF_WARPS_T"), WARPS.0);
        assert_eq!(define("WF_WARPS_K"), WARPS.1);
        assert_eq!(define("WF_TT"), TILES_PER_BLOCK);
        assert_eq!(define("WF_KC"), CHANNEL_CHUNK);
        assert_eq!(WARPS.0 * 16, TILES_PER_BLOCK);
        assert_eq!(WARPS.0 * WARPS.1 * 32, THREADS as usize);
        for tile in WinogradTile::ALL {
            let c = cfg(tile);
            // Every staged piece is one thread's, a whole number of rounds per thread.
            assert_eq!((TILES_PER_BLOCK * c.positions * 2) % THREADS as usize, 0);
            assert_eq!(
                (c.positions * CHANNEL_CHUNK * c.tk / 8) % THREADS as usize,
                0
            );
            // Regions and rows start on 16-byte boundaries (cp.async destinations).
            for bytes in [c.xs * 2, c.us * 2, c.vs * 2, c.xrow * 2, c.vrow * 2] {
                assert_eq!(bytes % 16, 0, "{tile:?}");
            }
            // Fits an H100 (227 KB) and an A100 (163 KB) block.
            assert!(
                c.smem_bytes + STATIC_SMEM <= 166_912,
                "{tile:?}: {}",
                c.smem_bytes
            );
        }
        assert_eq!(cfg(WinogradTile::F4x3).smem_bytes, 166_400);
        assert_eq!(cfg(WinogradTile::F4x3).tk, 32);
        assert_eq!(cfg(WinogradTile::F2x3).tk, 64);
        assert!(src.contains("static constexpr int NF = M == 4 ? 1 : 2;"));
        assert!(src.contains("static constexpr int XROW = P * WF_KC + 8;"));
        assert!(src.contains("static constexpr int VROW = TK + 8;"));
    }

    /// Bank-conflict freedom of the shared-memory accesses the design relies on (the 32 lanes of
    /// one warp instruction hit 32 different banks, or the same 4-byte word).
    #[test]
    fn shared_accesses_are_conflict_free() {
        fn distinct_banks(words: &[usize]) -> bool {
            let mut seen = std::collections::HashMap::new();
            for &w in words {
                let prev = seen.insert(w % 32, w);
                if prev.is_some_and(|p| p != w) {
                    return false;
                }
            }
            true
        }
        for tile in WinogradTile::ALL {
            let c = cfg(tile);
            let tt = TILES_PER_BLOCK;
            // A fragments: word ((kh * tt + row) * 4 + t), row = warp row + g (+8).
            for kh in 0..2 {
                for plus in [0, 8] {
                    let w: Vec<usize> = (0..32)
                        .map(|l| (kh * tt + 16 + l / 4 + plus) * 4 + l % 4)
                        .collect();
                    assert!(distinct_banks(&w), "{tile:?} A");
                }
            }
            // B fragments: ldmatrix reads one 8x8 matrix per phase, rows r0..r0+7 of 16 bytes
            // at stride vrow halves: the 8 rows must cover 32 different banks.
            for r0 in [0, 8] {
                for n0 in (0..c.tk).step_by(8) {
                    let w: Vec<usize> = (0..32)
                        .map(|l| ((r0 + l / 4) * c.vrow + n0) / 2 + l % 4)
                        .collect();
                    assert!(distinct_banks(&w), "{tile:?} B rows {r0}.. col {n0}");
                    assert_eq!(
                        ((r0 * c.vrow + n0) * 2) % 16,
                        0,
                        "ldmatrix rows 16-byte aligned"
                    );
                }
            }
            // Transform reads: tile w*4 + l/8, channel half*8 + l%8, tap fixed.
            for tap in [0, c.positions - 1] {
                for half in 0..2 {
                    let w: Vec<usize> = (0..32)
                        .map(|l| ((l / 8) * c.xrow + tap * CHANNEL_CHUNK + half * 8 + l % 8) / 2)
                        .collect();
                    assert!(distinct_banks(&w), "{tile:?} Xs");
                    // Transform writes of U.
                    let w: Vec<usize> = (0..32)
                        .map(|l| ((tap * 2 + half) * tt + l / 8) * 8 / 2 + (l % 8) / 2)
                        .collect();
                    assert!(distinct_banks(&w), "{tile:?} Us");
                }
            }
        }
    }

    #[test]
    fn grids_units_and_launches() {
        assert_eq!(grid(6272, 64, WinogradTile::F4x3).unwrap(), (196, 2));
        assert_eq!(grid(25088, 64, WinogradTile::F2x3).unwrap(), (784, 1));
        assert_eq!(grid(1, 8, WinogradTile::F4x3).unwrap(), (1, 1));
        assert_eq!(grid(33, 40, WinogradTile::F4x3).unwrap(), (2, 2));
        assert!(grid(MAX_LAUNCH_TILES + 1, 8, WinogradTile::F2x3).is_err());
        assert!(grid(32, 8 * 65_536 * 8, WinogradTile::F4x3).is_err());
        assert_eq!(launches(32, 196).unwrap(), vec![32]);
        let l = launches(5, MAX_LAUNCH_TILES / 2).unwrap();
        assert_eq!(l, vec![2, 2, 1]);
        assert!(launches(1, MAX_LAUNCH_TILES + 1).is_err());
        for dt in [DType::F16, DType::BF16] {
            for tile in WinogradTile::ALL {
                let name = kernel(dt, tile).unwrap();
                assert!(name.contains(tile.name()) && name.ends_with(dt.name()));
                let u = unit(dt, Some(tile)).unwrap();
                assert!(u.source.contains("#define NNF_WF_TILE"));
                assert!(u.name.contains(dt.name()) && u.name.contains(tile.name()));
            }
            assert!(probe_kernel(dt).unwrap().ends_with(dt.name()));
            assert!(unit(dt, None).unwrap().name.contains("probe"));
        }
        assert!(kernel(DType::F32, WinogradTile::F4x3).is_none());
        assert!(unit(DType::F32, None).is_none());
    }

    /// Each unit compiles exactly its kernel (needs NVRTC; skipped without it).
    #[test]
    fn units_compile_to_their_kernels() {
        if !crate::kernels::nvrtc_present() {
            eprintln!("skipping: NVRTC not found");
            return;
        }
        for (dt, tile) in [(DType::F16, Some(WinogradTile::F4x3)), (DType::BF16, None)] {
            let u = unit(dt, tile).unwrap();
            let ptx = crate::testutil::ptx_of(u);
            let entries = crate::testutil::ptx_entries(&ptx);
            assert_eq!(entries.len(), 1, "{entries:?}");
            let want = match tile {
                Some(t) => kernel(dt, t).unwrap(),
                None => probe_kernel(dt).unwrap(),
            };
            assert!(entries[0].starts_with(want), "{entries:?}");
        }
    }
}
