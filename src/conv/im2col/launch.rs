//! Launch arithmetic of `kernels/im2col.cu`: the kernels' geometry argument ([`ColGeom`], with
//! magic-number divisors, [`FastDiv`]), the choice of kernel (work mapping and copy unit), the
//! grid and the shared memory. Pure: no GPU. The tests emulate the kernels' index math on the
//! CPU, thread by thread, and compare with [`crate::reference::conv`].
//!
//! Kernel choice for im2col (the work mappings are described in `kernels/im2col.cu`):
//! - NCHW: `im2col_nchw_b2/b4` (a thread per pixel of [`ITEMS`] channels, taps in groups of
//!   [`TGROUP`] on `gridDim.z`).
//! - NHWC with an 8- or 16-byte copy unit ([`copy_unit_bytes`]): `im2col_nhwc_b8/b16`, flat
//!   over the column units.
//! - Other NHWC problems with dilation 1 along the width and filter rows of at least 16 bytes
//!   (`kw*c_in*elem >= 16`) whose staged rows fit [`ROWS_SMEM_MAX`]: `im2col_nhwc_rows_b2/b4`
//!   (shared-memory rows, 16-byte stores); the ResNet stem (c_in = 3) is one.
//! - Everything else: `im2col_nhwc_b2/b4` (flat, element or 4-byte units).

use cudarc::driver::{DeviceRepr, LaunchConfig};

use crate::conv::ConvShape;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::TensorFormat;

/// Threads per block of every kernel in `kernels/im2col.cu` (`THREADS` there).
pub(crate) const THREADS: u32 = 256;
/// NCHW im2col: channels per thread (`ITEMS` there).
pub(crate) const ITEMS: u32 = 4;
/// NCHW im2col: taps per `gridDim.z` group (even; raised for filters of more than 262,140 taps
/// so that `gridDim.z` stays within its limit).
pub(crate) const TGROUP: u32 = 4;
/// [`ColGeom::flags`] bit: the NCHW im2col kernel's column offsets fit 32 bits.
pub(crate) const NCHW_OFFSETS_32: u32 = 1;
/// [`ColGeom::flags`] bit: col2im adds the sum to x's old value (`dx +=`, one rounding) instead
/// of overwriting it.
pub(crate) const COL2IM_ADD: u32 = 2;
/// col2im: taps of a filter row loaded together (`SGROUP` there).
#[cfg(test)]
pub(crate) const SGROUP: u32 = 4;
/// Largest `gridDim.y` and `gridDim.z`; the kernels stride over further images.
pub(crate) const MAX_GRID_Y: u32 = 65_535;
/// Per-image item counts, extents and index sums stay at or below this: the kernels index an
/// image's items in 32 bits, [`FastDiv`] is exact below 2^31, and coordinates are `int`.
pub(crate) const MAX_EXTENT: usize = i32::MAX as usize;
/// Rows kernel: output bytes a block aims at (its pixels are `ceil(this / (K*elem))`, at most
/// the output row), so that staging is amortised over enough stores.
pub(crate) const ROWS_OUT_BYTES: usize = 32 * 1024;
/// Rows kernel: most shared memory a block may stage (bytes; several blocks share an SM).
pub(crate) const ROWS_SMEM_MAX: usize = 24 * 1024;

/// NHWC flat im2col: units per thread for a copy unit of `unit_bytes` (32 bytes in flight for
/// 16- and 8-byte units). Mirrors the `NNF_IM2COL_UNIT` instantiations in `kernels/im2col.cu`.
pub(crate) fn nhwc_ept(unit_bytes: usize) -> u32 {
    if unit_bytes == 16 {
        2
    } else {
        4
    }
}

/// `n / d` for `n < 2^31` as `(umulhi(n, mul) + n) >> shift` (Granlund–Montgomery's round-up
/// method): `shift = ceil(log2 d)`, `mul = ceil(2^(32+shift) / d) - 2^32`. The kernels divide
/// by the shape's runtime extents this way (an integer division by a runtime value costs tens of
/// instructions on a GPU). Mirrors `FastDiv` in `kernels/im2col.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct FastDiv {
    /// The divisor (at least 1).
    pub d: u32,
    /// The magic multiplier.
    pub mul: u32,
    /// The shift.
    pub shift: u32,
}

impl FastDiv {
    /// The divisor `d` (0 is treated as 1: no caller divides by 0, and it keeps the value safe).
    pub(crate) fn new(d: u32) -> FastDiv {
        let d = d.max(1);
        let shift = 32 - (d - 1).leading_zeros(); // ceil(log2 d); 0 for d = 1
        let big = 1u64 << (32 + shift); // at most 2^63
        let mul = (big.div_ceil(u64::from(d)) - (1u64 << 32)) as u32;
        FastDiv { d, mul, shift }
    }

    /// `n / d` exactly as the kernels compute it (`n < 2^31`).
    #[cfg(test)]
    pub(crate) fn div(self, n: u32) -> u32 {
        let hi = ((u64::from(n) * u64::from(self.mul)) >> 32) as u32;
        hi.wrapping_add(n) >> self.shift
    }
}

/// The geometry argument of every im2col/col2im kernel, field for field as `ColGeom` in
/// `kernels/im2col.cu` (328 bytes; `static_assert`ed there, tested here). "Units" are elements,
/// or for the NHWC unit kernels groups of `unit` channels copied at once.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct ColGeom {
    /// Units between images of x (im2col's source, col2im's output).
    pub x_img: u64,
    /// Units between images of the columns.
    pub col_img: u64,
    /// NCHW: units between consecutive taps `q` of the columns.
    pub col_row: u64,
    /// Work items per image: NCHW im2col `ceil(c_in / ITEMS) * P`, NHWC flat im2col `P * K`
    /// units, col2im x's units per image; unused by the rows kernel.
    pub count: u32,
    /// Input channels (NHWC unit kernels: units per pixel of x).
    pub c_in: u32,
    /// Input height.
    pub h: u32,
    /// Input width.
    pub w: u32,
    /// Filter height.
    pub kh: u32,
    /// Filter width.
    pub kw: u32,
    /// Output height.
    pub oh: u32,
    /// Output width.
    pub ow: u32,
    /// `oh * ow`.
    pub pixels: u32,
    /// `K = c_in * kh * kw` (NHWC unit kernels: units per pixel of the columns).
    pub taps: u32,
    /// `kh * kw`.
    pub khkw: u32,
    /// `kw * c_in` (units): one filter row of an NHWC patch.
    pub kwc: u32,
    /// `w * c_in` (units): one NHWC input row.
    pub wc: u32,
    /// Rows kernel: output pixels per block.
    pub tw: u32,
    /// Rows kernel: blocks per output row, `ceil(ow / tw)`.
    pub tiles: u32,
    /// Rows kernel: staged elements per filter row, `((tw - 1) * sw + kw) * c_in`.
    pub rowlen: u32,
    /// Rows kernel: the tile's row stride in elements (see [`RowsTiling`]).
    pub rstride: u32,
    /// NCHW im2col: taps per `gridDim.z` group (even).
    pub tgroup: u32,
    /// col2im: `sh / gcd(sh, dh)`, the step between the filter rows that reach an input row.
    pub rstep: u32,
    /// col2im: `sw / gcd(sw, dw)`, likewise along the width.
    pub sstep: u32,
    /// Bit 0, NCHW im2col: every column offset within an image (up to `K * col_row + P`)
    /// fits 32 bits, so that the kernel computes them in 32 bits.
    pub flags: u32,
    /// No implicit padding in the layout.
    pub unused: u32,
    /// Vertical stride.
    pub sh: i32,
    /// Horizontal stride.
    pub sw: i32,
    /// Vertical padding.
    pub ph: i32,
    /// Horizontal padding.
    pub pw: i32,
    /// Vertical dilation.
    pub dh: i32,
    /// Horizontal dilation.
    pub dw: i32,
    /// By `ow`.
    pub d_ow: FastDiv,
    /// By `c_in` (units).
    pub d_cin: FastDiv,
    /// By `pixels`.
    pub d_pixels: FastDiv,
    /// By `kwc`.
    pub d_kwc: FastDiv,
    /// By `w`.
    pub d_w: FastDiv,
    /// By `h * w`.
    pub d_hw: FastDiv,
    /// By the vertical stride.
    pub d_sh: FastDiv,
    /// By the horizontal stride.
    pub d_sw: FastDiv,
    /// By `taps`.
    pub d_taps: FastDiv,
    /// By `tiles`.
    pub d_tiles: FastDiv,
    /// By `kw`.
    pub d_kw: FastDiv,
    /// Rows kernel: by the 16-byte vectors staged per row, `ceil((rowlen + V - 1) / V)`.
    pub d_rowvec: FastDiv,
    /// col2im: by `rstep`.
    pub d_rstep: FastDiv,
    /// col2im: by `sstep`.
    pub d_sstep: FastDiv,
    /// col2im: by `doy = dh / gcd(sh, dh)`, the output rows between consecutive taps of a
    /// row progression.
    pub d_doy: FastDiv,
    /// col2im: by `dox = dw / gcd(sw, dw)`, likewise along the width.
    pub d_dox: FastDiv,
}

// SAFETY: plain `repr(C)` data of u64/u32/i32 fields, laid out as the kernels' `ColGeom`
// (checked by `col_geom_matches_the_kernel_layout`); passed by value as a kernel argument.
unsafe impl DeviceRepr for ColGeom {}

/// Where each image's columns go (NCHW; NHWC columns are always `[P][K]` per image): element
/// `(b, q, p)` at `b*img + q*row + p`. The reference layout `[n][K][P]` is `img = K*P, row = P`;
/// the filter gradient uses `[K][chunk][P]` (`img = P, row = chunk*P`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ColLayout {
    /// Elements between images.
    pub img: usize,
    /// NCHW: elements between taps `q` (ignored for NHWC, where it is `K`).
    pub row: usize,
}

impl ColLayout {
    /// The reference layout of `s` (`[n][K][P]` for NCHW, `[n][P][K]` for NHWC).
    pub(crate) fn standard(pixels: usize, taps: usize) -> ColLayout {
        ColLayout {
            img: pixels * taps,
            row: pixels,
        }
    }
}

fn too_big(what: &str, v: usize) -> Error {
    Error::NotSupported(format!(
        "im2col kernels: {what} = {v} exceeds {MAX_EXTENT}, the limit of their 32-bit per-image \
         indices"
    ))
}

fn small(what: &str, v: usize) -> Result<u32> {
    if v > MAX_EXTENT {
        return Err(too_big(what, v));
    }
    Ok(v as u32)
}

fn small_i(what: &str, v: usize) -> Result<i32> {
    small(what, v).map(|v| v as i32)
}

/// Checked product of per-image extents.
fn small_product(what: &str, dims: &[usize]) -> Result<usize> {
    let p = dims
        .iter()
        .try_fold(1usize, |p, &d| p.checked_mul(d))
        .unwrap_or(usize::MAX);
    small(what, p).map(|v| v as usize)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The geometry of `s` with NHWC channels grouped in units of `unit` elements (1 for NCHW and
/// the scalar kernels); `count` and the rows kernel's fields are left 0 and `tgroup` at
/// [`TGROUP`] for the caller to set.
pub(crate) fn geometry(s: &ConvShape, layout: ColLayout, unit: usize) -> Result<ColGeom> {
    let (oh, ow) = s.out_hw()?;
    let unit = unit.max(1);
    if s.format == TensorFormat::Nhwc && s.c_in % unit != 0 {
        return Err(Error::NotSupported(format!(
            "im2col kernels: c_in = {} is not a multiple of the {unit}-element copy unit",
            s.c_in
        )));
    }
    let pixels = small_product("oh*ow", &[oh, ow])?;
    let taps = small_product("c_in*kh*kw", &[s.c_in, s.kh, s.kw])?;
    small_product(
        "an image's column matrix (oh*ow*c_in*kh*kw)",
        &[pixels, taps],
    )?;
    small_product("an image's input (c_in*h*w)", &[s.c_in, s.h, s.w])?;
    // Coordinates: iy + ph <= h + 2*ph - 1 (likewise x) must fit an int, and for NHWC so must
    // the fused input-row offset ix*c_in + s*c_in + c.
    let padded_h = s.h.saturating_add(s.pad.0.saturating_mul(2));
    let padded_w = s.w.saturating_add(s.pad.1.saturating_mul(2));
    small("h + 2*pad.0", padded_h)?;
    small("w + 2*pad.1", padded_w)?;
    let (c_in_u, taps_u) = match s.format {
        TensorFormat::Nchw => (s.c_in, taps),
        TensorFormat::Nhwc => (s.c_in / unit, taps / unit),
    };
    if s.format == TensorFormat::Nhwc {
        let reach = padded_w.saturating_add(s.kw.saturating_mul(s.dilation.1));
        small(
            "(w + 2*pad.1 + kw*dilation.1)*c_in",
            reach.saturating_mul(c_in_u),
        )?;
    }
    let x_img = s.c_in * s.h * s.w
        / if s.format == TensorFormat::Nhwc {
            unit
        } else {
            1
        };
    let (col_img, col_row) = match s.format {
        TensorFormat::Nchw => (layout.img, layout.row),
        TensorFormat::Nhwc => (layout.img / unit, taps_u),
    };
    let u = |v: usize| v as u32; // each value below was checked above
    let (gh, gw) = (gcd(s.stride.0, s.dilation.0), gcd(s.stride.1, s.dilation.1));
    Ok(ColGeom {
        x_img: x_img as u64,
        col_img: col_img as u64,
        col_row: col_row as u64,
        count: 0,
        c_in: u(c_in_u),
        h: u(s.h),
        w: u(s.w),
        kh: u(s.kh),
        kw: u(s.kw),
        oh: u(oh),
        ow: u(ow),
        pixels: u(pixels),
        taps: u(taps_u),
        khkw: u(s.kh * s.kw),
        kwc: u(s.kw * c_in_u),
        wc: u(s.w * c_in_u),
        tw: 0,
        tiles: 0,
        rowlen: 0,
        rstride: 0,
        tgroup: TGROUP,
        rstep: u(s.stride.0 / gh),
        sstep: u(s.stride.1 / gw),
        flags: 0,
        unused: 0,
        sh: small_i("stride.0", s.stride.0)?,
        sw: small_i("stride.1", s.stride.1)?,
        ph: small_i("pad.0", s.pad.0)?,
        pw: small_i("pad.1", s.pad.1)?,
        dh: small_i("dilation.0", s.dilation.0)?,
        dw: small_i("dilation.1", s.dilation.1)?,
        d_ow: FastDiv::new(u(ow)),
        d_cin: FastDiv::new(u(c_in_u)),
        d_pixels: FastDiv::new(u(pixels)),
        d_kwc: FastDiv::new(u(s.kw * c_in_u)),
        d_w: FastDiv::new(u(s.w)),
        d_hw: FastDiv::new(u(s.h * s.w)),
        d_sh: FastDiv::new(u(s.stride.0)),
        d_sw: FastDiv::new(u(s.stride.1)),
        d_taps: FastDiv::new(u(taps_u)),
        d_tiles: FastDiv::new(1),
        d_kw: FastDiv::new(u(s.kw)),
        d_rowvec: FastDiv::new(1),
        d_rstep: FastDiv::new(u(s.stride.0 / gh)),
        d_sstep: FastDiv::new(u(s.stride.1 / gw)),
        d_doy: FastDiv::new(u(s.dilation.0 / gh)),
        d_dox: FastDiv::new(u(s.dilation.1 / gw)),
    })
}

/// One launch of an im2col/col2im kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Launch {
    /// The kernel's name in `kernels/im2col.cu`.
    pub kernel: &'static str,
    /// `(gridDim.x, gridDim.y, gridDim.z)`; blocks of [`THREADS`].
    pub grid: (u32, u32, u32),
    /// Dynamic shared memory per block (bytes).
    pub smem: u32,
    /// The geometry argument.
    pub geom: ColGeom,
    /// Images of the chunk (the kernels' `images` argument).
    pub images: u32,
    /// Elements each work item moves (the copy unit: 1, or channels per 4/8/16-byte unit).
    pub unit: usize,
    /// The source address the launch was planned for (the rows kernel aligns its staging to
    /// it; the CPU emulation needs it to do the same).
    pub src_addr: u64,
    /// The destination address the launch was planned for (the rows kernel aligns its stores
    /// to it).
    pub dst_addr: u64,
}

impl Launch {
    /// As cudarc's launch configuration.
    pub(crate) fn config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: self.grid,
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: self.smem,
        }
    }
}

/// `(gridDim.x, gridDim.y)` for `blocks` blocks per image, and the image count as the kernels
/// take it.
fn grid_for(blocks: u32, images: usize) -> Result<((u32, u32), u32)> {
    let images = u32::try_from(images)
        .map_err(|_| Error::NotSupported(format!("im2col kernels: {images} images in a chunk")))?;
    Ok(((blocks.max(1), images.clamp(1, MAX_GRID_Y)), images))
}

/// Bytes of the NHWC copy unit: the largest of 16, 8, 4 and the element size that divides a
/// tap's channel run (`c_in * elem` bytes) and both addresses (x's first image and the columns'
/// first element). NCHW always copies single elements.
pub(crate) fn copy_unit_bytes(
    format: TensorFormat,
    c_in: usize,
    elem: usize,
    ptrs: &[u64],
) -> usize {
    if format == TensorFormat::Nchw {
        return elem;
    }
    let run = c_in * elem;
    [16usize, 8, 4]
        .into_iter()
        .filter(|&u| u > elem)
        .find(|&u| run % u == 0 && ptrs.iter().all(|&p| p % u as u64 == 0))
        .unwrap_or(elem)
}

/// The rows kernel's tiling: `tw` output pixels per block (`tiles` blocks per output row), each
/// block staging `kh` row segments of `rowlen` elements in a shared-memory tile whose rows are
/// `rstride` elements apart: at least `rowlen + 2V - 1` (V = 16 / elem), so that a row's 16-byte
/// vectors never touch the next row's, and congruent to `dh * w * c_in` modulo V, so that every
/// staged element keeps its position within a 16-byte vector of x.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowsTiling {
    /// Output pixels per block.
    pub tw: u32,
    /// Blocks per output row.
    pub tiles: u32,
    /// Staged elements per row, `((tw - 1) * sw + kw) * c_in`.
    pub rowlen: u32,
    /// The tile's row stride (elements).
    pub rstride: u32,
    /// 16-byte vectors staged per row, `ceil((rowlen + V - 1) / V)`.
    pub rowvecs: u32,
    /// Shared memory per block (bytes): `ceil(kh * rstride / V)` vectors.
    pub smem: u32,
}

/// The rows kernel's tiling of `s` for `elem`-byte elements, or `None` when the kernel does not
/// apply (NCHW, dilation along the width, filter rows under 16 bytes, or not even one pixel's
/// rows fit [`ROWS_SMEM_MAX`]).
pub(crate) fn rows_tiling(s: &ConvShape, elem: usize) -> Option<RowsTiling> {
    let (oh, ow) = s.out_hw().ok()?;
    let taps = s.c_in.checked_mul(s.kh)?.checked_mul(s.kw)?;
    if s.format != TensorFormat::Nhwc
        || !(elem == 2 || elem == 4)
        || s.dilation.1 != 1
        || s.kw.saturating_mul(s.c_in).saturating_mul(elem) < 16
        || oh == 0
        || ow == 0
    {
        return None;
    }
    let v = 16 / elem;
    // Staged elements per filter row for tw pixels: ((tw - 1) * sw + kw) * c_in.
    let row_elems = |tw: usize| ((tw - 1) * s.stride.1 + s.kw) * s.c_in;
    // A tile row takes at most rowlen + 4V - 3 elements (the stride's rounding and congruence).
    let per_row_budget = (ROWS_SMEM_MAX / s.kh.saturating_mul(elem)).saturating_sub(4 * v);
    if s.kw * s.c_in > per_row_budget {
        return None;
    }
    let by_out = ROWS_OUT_BYTES
        .div_ceil(taps.saturating_mul(elem))
        .clamp(1, ow);
    // The most pixels whose staged rows fit (row_elems(1) fits, checked above).
    let by_smem = (per_row_budget / s.c_in - s.kw) / s.stride.1 + 1;
    // tiles * tw >= ow > (tiles - 1) * tw: every block has at least one pixel.
    let tiles = ow.div_ceil(by_out.min(by_smem));
    let tw = ow.div_ceil(tiles);
    let rowlen = row_elems(tw);
    let wc_mod = ((s.dilation.0 % v) * ((s.w % v) * (s.c_in % v) % v)) % v; // dh*w*c_in mod V
    let rstride = (rowlen + 2 * v - 1).next_multiple_of(v) + wc_mod;
    let smem = s.kh.checked_mul(rstride)?.div_ceil(v) * 16;
    // The last block's staged segment reaches up to (tiles*tw - 1)*sw - pw + kw input columns:
    // its fused offsets (times c_in) must fit an int.
    let reach = (tiles * tw)
        .saturating_mul(s.stride.1)
        .saturating_add(s.kw)
        .saturating_mul(s.c_in);
    if smem > ROWS_SMEM_MAX || reach > MAX_EXTENT {
        return None;
    }
    let u = |x: usize| x as u32; // all below ROWS_SMEM_MAX or ow
    Some(RowsTiling {
        tw: u(tw),
        tiles: u(tiles),
        rowlen: u(rowlen),
        rstride: u(rstride),
        rowvecs: u((rowlen + v - 1).div_ceil(v)),
        smem: u(smem),
    })
}

/// The im2col launch for `images` images of `s` (x at `x_addr`, columns at `cols_addr` in
/// `layout`), for elements of `elem` bytes.
pub(crate) fn im2col(
    s: &ConvShape,
    layout: ColLayout,
    elem: usize,
    images: usize,
    x_addr: u64,
    cols_addr: u64,
) -> Result<Launch> {
    let unit_bytes = copy_unit_bytes(s.format, s.c_in, elem, &[x_addr, cols_addr]);
    let rows = if unit_bytes < 8 {
        rows_tiling(s, elem)
    } else {
        None
    };
    if let Some(t) = rows {
        let mut geom = geometry(s, layout, 1)?;
        geom.tw = t.tw;
        geom.tiles = t.tiles;
        geom.rowlen = t.rowlen;
        geom.rstride = t.rstride;
        geom.d_tiles = FastDiv::new(t.tiles);
        geom.d_rowvec = FastDiv::new(t.rowvecs);
        let kernel = match elem {
            2 => "im2col_nhwc_rows_b2",
            4 => "im2col_nhwc_rows_b4",
            _ => {
                return Err(Error::NotSupported(format!(
                    "im2col kernels: no kernel for {elem}-byte elements"
                )))
            }
        };
        // oh * tiles <= oh * ow < 2^31 blocks.
        let ((bx, by), images) = grid_for(geom.oh * t.tiles, images)?;
        return Ok(Launch {
            kernel,
            grid: (bx, by, 1),
            smem: t.smem,
            geom,
            images,
            unit: 1,
            src_addr: x_addr,
            dst_addr: cols_addr,
        });
    }
    let unit = unit_bytes / elem;
    let mut geom = geometry(s, layout, unit)?;
    // Both counts were checked in geometry(): ceil(c_in/ITEMS)*P <= c_in*kh*kw*P, and P*K.
    let (blocks, z) = match s.format {
        TensorFormat::Nchw => {
            geom.count = geom.c_in.div_ceil(ITEMS) * geom.pixels;
            // Even groups of taps, at most MAX_GRID_Y of them.
            let tg = TGROUP.max(geom.khkw.div_ceil(MAX_GRID_Y).next_multiple_of(2));
            geom.tgroup = tg;
            let reach = u64::from(geom.taps) * geom.col_row + u64::from(geom.pixels);
            if reach <= u64::from(u32::MAX) {
                geom.flags |= NCHW_OFFSETS_32;
            }
            (geom.count.div_ceil(THREADS), geom.khkw.div_ceil(tg))
        }
        TensorFormat::Nhwc => {
            geom.count = geom.pixels * geom.taps;
            (geom.count.div_ceil(THREADS * nhwc_ept(unit_bytes)), 1)
        }
    };
    let kernel = match (s.format, unit_bytes) {
        (TensorFormat::Nchw, 2) => "im2col_nchw_b2",
        (TensorFormat::Nchw, 4) => "im2col_nchw_b4",
        (TensorFormat::Nhwc, 2) => "im2col_nhwc_b2",
        (TensorFormat::Nhwc, 4) => "im2col_nhwc_b4",
        (TensorFormat::Nhwc, 8) => "im2col_nhwc_b8",
        (TensorFormat::Nhwc, 16) => "im2col_nhwc_b16",
        _ => {
            return Err(Error::NotSupported(format!(
                "im2col kernels: no kernel for {elem}-byte elements in {:?}",
                s.format
            )))
        }
    };
    let ((bx, by), images) = grid_for(blocks, images)?;
    Ok(Launch {
        kernel,
        grid: (bx, by, z),
        smem: 0,
        geom,
        images,
        unit,
        src_addr: x_addr,
        dst_addr: cols_addr,
    })
}

/// Bytes of col2im's NHWC work unit: the largest of 16, 8, 4 (above the element size) that
/// divides a tap's channel run and both addresses, else the element (the scalar kernel). NCHW
/// always sums single elements.
pub(crate) fn col2im_unit_bytes(
    format: TensorFormat,
    c_in: usize,
    elem: usize,
    ptrs: &[u64],
) -> usize {
    copy_unit_bytes(format, c_in, elem, ptrs)
}

/// The col2im launch for `images` images of `s`: columns in the reference layout at
/// `cols_addr`, the input gradient at `x_addr`, overwritten or (`add`) added to.
pub(crate) fn col2im(
    s: &ConvShape,
    dtype: DType,
    images: usize,
    cols_addr: u64,
    x_addr: u64,
    add: bool,
) -> Result<Launch> {
    let elem = dtype.size();
    let unit_bytes = col2im_unit_bytes(s.format, s.c_in, elem, &[cols_addr, x_addr]);
    let unit = unit_bytes / elem;
    let (oh, ow) = s.out_hw()?;
    let layout = ColLayout::standard(oh * ow, s.c_in * s.kh * s.kw);
    let mut geom = geometry(s, layout, unit)?;
    geom.count = geom.c_in * geom.h * geom.w; // c_in*h*w (in units) was checked in geometry()
    if add {
        geom.flags |= COL2IM_ADD;
    }
    let blocks = geom.count.div_ceil(THREADS);
    let kernel = match (s.format, unit_bytes, dtype) {
        (TensorFormat::Nchw, _, DType::F32) => "col2im_nchw_f32",
        (TensorFormat::Nchw, _, DType::F16) => "col2im_nchw_f16",
        (TensorFormat::Nchw, _, DType::BF16) => "col2im_nchw_bf16",
        (TensorFormat::Nhwc, 16, DType::F32) => "col2im_nhwc_v16_f32",
        (TensorFormat::Nhwc, 16, DType::F16) => "col2im_nhwc_v16_f16",
        (TensorFormat::Nhwc, 16, DType::BF16) => "col2im_nhwc_v16_bf16",
        (TensorFormat::Nhwc, 8, DType::F32) => "col2im_nhwc_v8_f32",
        (TensorFormat::Nhwc, 8, DType::F16) => "col2im_nhwc_v8_f16",
        (TensorFormat::Nhwc, 8, DType::BF16) => "col2im_nhwc_v8_bf16",
        (TensorFormat::Nhwc, 4, DType::F16) => "col2im_nhwc_v4_f16",
        (TensorFormat::Nhwc, 4, DType::BF16) => "col2im_nhwc_v4_bf16",
        (TensorFormat::Nhwc, _, DType::F32) => "col2im_nhwc_f32",
        (TensorFormat::Nhwc, _, DType::F16) => "col2im_nhwc_f16",
        (TensorFormat::Nhwc, _, DType::BF16) => "col2im_nhwc_bf16",
    };
    let ((bx, by), images) = grid_for(blocks, images)?;
    Ok(Launch {
        kernel,
        grid: (bx, by, 1),
        smem: 0,
        geom,
        images,
        unit,
        src_addr: cols_addr,
        dst_addr: x_addr,
    })
}

/// The filter-gradient accumulation kernel for `dtype`.
pub(crate) fn accumulate_kernel(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "conv_accumulate_f32",
        DType::F16 => "conv_accumulate_f16",
        DType::BF16 => "conv_accumulate_bf16",
    }
}

/// Every kernel name the launchers above can return (checked against the compiled file).
#[cfg(test)]
pub(crate) const KERNELS: &[&str] = &[
    "im2col_nchw_b2",
    "im2col_nchw_b4",
    "im2col_nhwc_b2",
    "im2col_nhwc_b4",
    "im2col_nhwc_b8",
    "im2col_nhwc_b16",
    "im2col_nhwc_rows_b2",
    "im2col_nhwc_rows_b4",
    "col2im_nchw_f32",
    "col2im_nchw_f16",
    "col2im_nchw_bf16",
    "col2im_nhwc_f32",
    "col2im_nhwc_f16",
    "col2im_nhwc_bf16",
    "col2im_nhwc_v4_f16",
    "col2im_nhwc_v4_bf16",
    "col2im_nhwc_v8_f32",
    "col2im_nhwc_v8_f16",
    "col2im_nhwc_v8_bf16",
    "col2im_nhwc_v16_f32",
    "col2im_nhwc_v16_f16",
    "col2im_nhwc_v16_bf16",
    "conv_accumulate_f32",
    "conv_accumulate_f16",
    "conv_accumulate_bf16",
    "conv_piece_ptrs",
    "conv_sum_parts_f32",
];

/// CPU emulations of the kernels, statement for statement, over the whole grid (every block,
/// every thread, every work item), on f64 buffers indexed in elements. Every load a kernel
/// issues is performed (also the clamped loads of padding taps), so that an out-of-bounds
/// address panics here.
#[cfg(test)]
pub(crate) mod emulate {
    use super::*;

    /// `x[at]` (bounds-checked) when `inside`, else the padding's zero; the kernels' `tap_value`.
    fn tap(x: &[f64], base: u64, inside: bool, at: u32) -> f64 {
        let v = x[(base + u64::from(if inside { at } else { 0 })) as usize];
        if inside {
            v
        } else {
            0.0
        }
    }

    /// The im2col kernels of `kernels/im2col.cu` (chosen by the launch's name); x and the
    /// columns in elements, each unit index `i` standing for elements `i*u .. i*u + u`.
    pub(crate) fn im2col(l: &Launch, x: &[f64], cols: &mut [f64]) {
        if l.kernel.starts_with("im2col_nchw") {
            nchw(l, x, cols);
        } else if l.kernel.starts_with("im2col_nhwc_rows") {
            rows(l, x, cols);
        } else {
            nhwc(l, x, cols);
        }
    }

    fn nchw(l: &Launch, x: &[f64], cols: &mut [f64]) {
        let g = &l.geom;
        assert_eq!(l.unit, 1);
        let off32 = g.flags & NCHW_OFFSETS_32 != 0;
        let items = ITEMS as usize;
        for bz in 0..l.grid.2 {
            for by in 0..l.grid.1 {
                for bx in 0..l.grid.0 {
                    for t in 0..THREADS {
                        let e = bx * THREADS + t;
                        if e >= g.count {
                            continue;
                        }
                        let cg = g.d_pixels.div(e);
                        let p = e - cg * g.pixels;
                        let oy = g.d_ow.div(p);
                        let ox = p - oy * g.ow;
                        let iy0 = oy as i32 * g.sh - g.ph;
                        let ix0 = ox as i32 * g.sw - g.pw;
                        let c0 = cg * ITEMS;
                        let live = (g.c_in - c0).min(ITEMS);
                        let plane_len = g.h * g.w;
                        let col_row = g.col_row;
                        let chan_rows = u64::from(g.khkw) * col_row;
                        let plane_off: Vec<u32> = (0..ITEMS)
                            .map(|i| if i < live { i * plane_len } else { 0 })
                            .collect();
                        let chan_off: Vec<u64> = (0..ITEMS)
                            .map(|i| {
                                if i < live {
                                    u64::from(i) * chan_rows
                                } else {
                                    0
                                }
                            })
                            .collect();
                        let t0 = bz * g.tgroup;
                        let t1 = (t0 + g.tgroup).min(g.khkw);
                        let r0 = g.d_kw.div(t0);
                        let s0 = t0 - r0 * g.kw;
                        let mut b = by;
                        while b < l.images {
                            let xb = u64::from(b) * g.x_img + u64::from(c0 * plane_len);
                            let cb = u64::from(b) * g.col_img;
                            let mut row =
                                u64::from(c0) * chan_rows + u64::from(t0) * col_row + u64::from(p);
                            let (mut dy, mut dx, mut s) = (r0 as i32 * g.dh, s0 as i32 * g.dw, s0);
                            // `load` of the kernel: one tap's values, then the odometer.
                            let load = |dy: &mut i32, dx: &mut i32, s: &mut u32| {
                                let (iy, ix) = (iy0 + *dy, ix0 + *dx);
                                let inside = (iy as u32) < g.h && (ix as u32) < g.w;
                                let at = if inside {
                                    iy as u32 * g.w + ix as u32
                                } else {
                                    0
                                };
                                // The kernel loads at + plane_off[i] even outside (at = 0).
                                let v: Vec<f64> = plane_off
                                    .iter()
                                    .map(|&o| {
                                        let val = x[(xb + u64::from(at + o)) as usize];
                                        if inside {
                                            val
                                        } else {
                                            0.0
                                        }
                                    })
                                    .collect();
                                *dx += g.dw;
                                *s += 1;
                                if *s == g.kw {
                                    *s = 0;
                                    *dx = 0;
                                    *dy += g.dh;
                                }
                                v
                            };
                            let mut store = |at: u64, v: &[f64]| {
                                if off32 {
                                    assert!(at <= u64::from(u32::MAX), "32-bit offset overflow");
                                }
                                for i in 0..items {
                                    let dst = (cb + at + chan_off[i]) as usize;
                                    if i as u32 >= live {
                                        // A dead channel rewrites channel c0's value in place.
                                        assert_eq!(v[i].to_bits(), v[0].to_bits());
                                        assert_eq!(chan_off[i], 0);
                                    }
                                    cols[dst] = v[i];
                                }
                            };
                            let mut tap_t = t0;
                            while tap_t + 2 <= t1 {
                                let v0 = load(&mut dy, &mut dx, &mut s);
                                let v1 = load(&mut dy, &mut dx, &mut s);
                                store(row, &v0);
                                store(row + col_row, &v1);
                                row += 2 * col_row;
                                tap_t += 2;
                            }
                            if tap_t < t1 {
                                let v0 = load(&mut dy, &mut dx, &mut s);
                                store(row, &v0);
                            }
                            b += l.grid.1;
                        }
                    }
                }
            }
        }
    }

    fn nhwc(l: &Launch, x: &[f64], cols: &mut [f64]) {
        let g = &l.geom;
        let u = l.unit;
        // EPT as instantiated in the .cu file (b16: 2 units; b2, b4, b8: 4).
        let ept = if l.kernel.ends_with("_b16") { 2 } else { 4 };
        assert_eq!(l.grid.2, 1);
        for by in 0..l.grid.1 {
            for bx in 0..l.grid.0 {
                for t in 0..THREADS {
                    let first = bx * (THREADS * ept) + t;
                    if first >= g.count {
                        continue;
                    }
                    let mut src = vec![0u32; ept as usize];
                    let mut inside = vec![false; ept as usize];
                    let mut live = vec![false; ept as usize];
                    for j in 0..ept as usize {
                        let e0 = first + j as u32 * THREADS;
                        live[j] = e0 < g.count;
                        let e = if live[j] { e0 } else { first };
                        let p = g.d_taps.div(e);
                        let q = e - p * g.taps;
                        let oy = g.d_ow.div(p);
                        let ox = p - oy * g.ow;
                        let r = g.d_kwc.div(q);
                        let jj = q - r * g.kwc;
                        let iy = oy as i32 * g.sh - g.ph + r as i32 * g.dh;
                        let ix0 = ox as i32 * g.sw - g.pw;
                        if g.dw == 1 {
                            let xc = ix0 * g.c_in as i32 + jj as i32;
                            inside[j] = (iy as u32) < g.h && (xc as u32) < g.wc;
                            src[j] = (iy as u32).wrapping_mul(g.wc).wrapping_add(xc as u32);
                        } else {
                            let s = g.d_cin.div(jj);
                            let c = jj - s * g.c_in;
                            let ix = ix0 + s as i32 * g.dw;
                            inside[j] = (iy as u32) < g.h && (ix as u32) < g.w;
                            src[j] = (iy as u32)
                                .wrapping_mul(g.w)
                                .wrapping_add(ix as u32)
                                .wrapping_mul(g.c_in)
                                .wrapping_add(c);
                        }
                    }
                    let mut b = by;
                    while b < l.images {
                        let xb = u64::from(b) * g.x_img;
                        let cb = u64::from(b) * g.col_img;
                        for j in 0..ept as usize {
                            // One unit: u elements.
                            let at = if inside[j] { src[j] } else { 0 };
                            let vals: Vec<f64> = (0..u)
                                .map(|k| {
                                    let v = x[(xb + u64::from(at)) as usize * u + k];
                                    if inside[j] {
                                        v
                                    } else {
                                        0.0
                                    }
                                })
                                .collect();
                            if live[j] {
                                let dst = (cb + u64::from(first + j as u32 * THREADS)) as usize;
                                cols[dst * u..dst * u + u].copy_from_slice(&vals);
                            }
                        }
                        b += l.grid.1;
                    }
                }
            }
        }
    }

    /// `staged_at` of the rows kernel.
    fn staged_at(i: u32, off: u32, g: &ColGeom) -> u32 {
        let pl = g.d_taps.div(i);
        let q = i - pl * g.taps;
        let r = g.d_kwc.div(q);
        let j = q - r * g.kwc;
        r * g.rstride + off + pl * g.sw as u32 * g.c_in + j
    }

    fn rows(l: &Launch, x: &[f64], cols: &mut [f64]) {
        let g = &l.geom;
        let elem: u64 = if l.kernel.ends_with("_b2") { 2 } else { 4 };
        let v_len = (16 / elem) as u32;
        assert_eq!((l.unit, l.grid.2), (1, 1));
        assert_eq!(l.dst_addr % elem, 0, "columns not aligned to their element");
        assert_eq!(l.src_addr % elem, 0, "x not aligned to its element");
        let tile_len = l.smem as usize / elem as usize;
        let rowvecs = g.d_rowvec.d;
        let nvec = g.kh * rowvecs;
        for by in 0..l.grid.1 {
            for bx in 0..l.grid.0 {
                let oy = g.d_tiles.div(bx);
                let ox0 = (bx - oy * g.tiles) * g.tw;
                let npix = g.tw.min(g.ow - ox0);
                let iys = oy as i32 * g.sh - g.ph;
                let xcs = (ox0 as i32 * g.sw - g.pw) * g.c_in as i32;
                let len = npix * g.taps;
                let start = (oy * g.ow + ox0) * g.taps;
                let step = g.sw as u32 * g.c_in;
                let mut b = by;
                while b < l.images {
                    let xb = u64::from(b) * g.x_img;
                    let xb_elem = l.src_addr / elem + xb; // x's image address in elements
                    let off = (xb_elem as u32)
                        .wrapping_add((iys as u32).wrapping_mul(g.wc))
                        .wrapping_add(xcs as u32)
                        & (v_len - 1);
                    // None: never staged (reading it is a bug); a vector staged twice is too.
                    let mut tile: Vec<Option<f64>> = vec![None; tile_len];
                    let mut staged = vec![false; tile_len / v_len as usize];
                    for t in 0..THREADS {
                        let mut n0 = t;
                        while n0 < nvec {
                            for u in 0..2 {
                                let n_in = n0 + u * THREADS;
                                let n = n_in.min(nvec - 1);
                                let r = g.d_rowvec.div(n);
                                let vi = n - r * rowvecs;
                                let iy = iys + r as i32 * g.dh;
                                let first = r * g.rstride + off;
                                let at = first / v_len + vi;
                                let xc0 = xcs
                                    + vi.wrapping_mul(v_len).wrapping_sub(first & (v_len - 1))
                                        as i32;
                                let row_in = (iy as u32) < g.h;
                                let row = if row_in { iy as u32 * g.wc } else { 0 };
                                let whole = row_in && xc0 >= 0 && xc0 + v_len as i32 <= g.wc as i32;
                                let vals: Vec<f64> = if whole {
                                    let e0 = xb + u64::from(row) + xc0 as u64;
                                    assert_eq!(
                                        (l.src_addr / elem + e0) % u64::from(v_len),
                                        0,
                                        "16-byte load at a misaligned address"
                                    );
                                    (0..v_len)
                                        .map(|k| x[(e0 + u64::from(k)) as usize])
                                        .collect()
                                } else {
                                    (0..v_len as i32)
                                        .map(|k| {
                                            let xc = xc0 + k;
                                            let ok = row_in && (xc as u32) < g.wc;
                                            tap(x, xb + u64::from(row), ok, xc as u32)
                                        })
                                        .collect()
                                };
                                if n_in < nvec {
                                    assert!(!staged[at as usize], "tile vector {at} staged twice");
                                    staged[at as usize] = true;
                                    for (k, v) in vals.into_iter().enumerate() {
                                        tile[(at * v_len) as usize + k] = Some(v);
                                    }
                                }
                            }
                            n0 += 2 * THREADS;
                        }
                    }
                    let out = u64::from(b) * g.col_img + u64::from(start);
                    let mis = ((l.dst_addr / elem + out) % u64::from(v_len)) as u32;
                    let head = ((v_len - mis) & (v_len - 1)).min(len);
                    let chunks = (len - head) / v_len;
                    let tail = head + chunks * v_len;
                    let read = |at: u32| -> f64 {
                        tile[at as usize].unwrap_or_else(|| panic!("tile[{at}] read unstaged"))
                    };
                    for t in 0..THREADS {
                        if t < head {
                            cols[(out + u64::from(t)) as usize] = read(staged_at(t, off, g));
                        }
                        if tail + t < len {
                            let i = tail + t;
                            cols[(out + u64::from(i)) as usize] = read(staged_at(i, off, g));
                        }
                        let mut m = t;
                        while m < chunks {
                            let i = head + m * v_len;
                            let pl = g.d_taps.div(i);
                            let q = i - pl * g.taps;
                            let r = g.d_kwc.div(q);
                            let j = q - r * g.kwc;
                            let a1 = r * g.rstride + off + pl * step + j;
                            let n1 = g.kwc - j;
                            let a2 = if r + 1 < g.kh {
                                a1 - j + g.rstride
                            } else {
                                off + (pl + 1) * step
                            };
                            let dst = out + u64::from(i);
                            assert_eq!(
                                (l.dst_addr + dst * elem) % 16,
                                0,
                                "16-byte store at a misaligned address"
                            );
                            for k in 0..v_len {
                                // p1 = tile + a1, p2 = tile + a2 - n1.
                                let at = if k < n1 { a1 + k } else { a2 + k - n1 };
                                cols[(dst + u64::from(k)) as usize] = read(at);
                            }
                            m += THREADS;
                        }
                    }
                    b += l.grid.1;
                }
            }
        }
    }

    /// `first_tap` of the kernel.
    fn first_tap(ipad: i32, dil: i32, stride: i32, ds: FastDiv, step: u32) -> u32 {
        if stride == 1 {
            return 0;
        }
        for k in 0..step {
            let t = ipad - k as i32 * dil;
            if t < 0 {
                break;
            }
            if ds.div(t as u32).wrapping_mul(stride as u32) as i32 == t {
                return k;
            }
        }
        u32::MAX
    }

    /// `exact_div` of the kernel.
    fn exact_div(t: i32, stride: i32, ds: FastDiv) -> u32 {
        if stride == 1 {
            t as u32
        } else {
            ds.div(t as u32)
        }
    }

    /// `tap_range` of the kernel: `(count, first tap, its output index)`.
    #[allow(clippy::too_many_arguments)]
    fn tap_range(
        ipad: i32,
        dil: i32,
        stride: i32,
        ds: FastDiv,
        kstep: u32,
        dk: FastDiv,
        dout: FastDiv,
        kext: u32,
        out: u32,
    ) -> (u32, u32, u32) {
        let k0 = first_tap(ipad, dil, stride, ds, kstep);
        if k0 >= kext {
            return (0, 0, 0);
        }
        let o0 = exact_div(ipad - k0 as i32 * dil, stride, ds);
        let hi = dk.div(kext - 1 - k0).min(dout.div(o0));
        let lo = if o0 >= out {
            dout.div(o0 - out + dout.d)
        } else {
            0
        };
        if lo > hi {
            return (0, 0, 0);
        }
        (hi - lo + 1, k0 + lo * kstep, o0 - lo * dout.d)
    }

    /// The col2im kernels of `kernels/im2col.cu` (NCHW, NHWC scalar and 4/8/16-byte units),
    /// summing in f64 in the kernel's order.
    pub(crate) fn col2im(l: &Launch, cols: &[f64], x: &mut [f64]) {
        let g = &l.geom;
        let u = l.unit;
        let nchw = l.kernel.starts_with("col2im_nchw");
        assert_eq!(l.grid.2, 1);
        for by in 0..l.grid.1 {
            for bx in 0..l.grid.0 {
                for t in 0..THREADS {
                    let e = bx * THREADS + t;
                    if e >= g.count {
                        continue;
                    }
                    let (c, iy, ix) = if nchw {
                        let c = g.d_hw.div(e);
                        let pix = e - c * g.d_hw.d;
                        let iy = g.d_w.div(pix);
                        (c, iy, pix - iy * g.w)
                    } else {
                        let pix = g.d_cin.div(e);
                        let c = e - pix * g.c_in;
                        let iy = g.d_w.div(pix);
                        (c, iy, pix - iy * g.w)
                    };
                    let (ra, rk, ro) = tap_range(
                        iy as i32 + g.ph,
                        g.dh,
                        g.sh,
                        g.d_sh,
                        g.rstep,
                        g.d_rstep,
                        g.d_doy,
                        g.kh,
                        g.oh,
                    );
                    let (sm, sk, so) = tap_range(
                        ix as i32 + g.pw,
                        g.dw,
                        g.sw,
                        g.d_sw,
                        g.sstep,
                        g.d_sstep,
                        g.d_dox,
                        g.kw,
                        g.ow,
                    );
                    let (na, nm) = (if sm == 0 { 0 } else { ra }, sm);
                    let (at0, da, dm) = if nchw {
                        let p = g.col_row as u32;
                        (
                            ((c * g.kh + rk) * g.kw + sk) * p + ro * g.ow + so,
                            (g.rstep * g.kw * p).wrapping_sub(g.d_doy.d * g.ow),
                            (g.sstep * p).wrapping_sub(g.d_dox.d),
                        )
                    } else {
                        (
                            (ro * g.ow + so) * g.taps + (rk * g.kw + sk) * g.c_in + c,
                            (g.rstep * g.kw * g.c_in).wrapping_sub(g.d_doy.d * g.ow * g.taps),
                            (g.sstep * g.c_in).wrapping_sub(g.d_dox.d * g.taps),
                        )
                    };
                    // The taps the loops visit, checked against the definition: tap (r, s)
                    // reads (iy, ix) from output (oy, ox) = ((iy + ph - r*dh) / sh, ...).
                    let mut b = by;
                    while b < l.images {
                        let cb = b as usize * g.col_img as usize * u;
                        let xb = b as usize * g.x_img as usize * u;
                        let mut acc = vec![0.0; u];
                        let mut row = at0;
                        for a in 0..na {
                            let (r, oy) = (rk + a * g.rstep, ro - a * g.d_doy.d);
                            assert_eq!(iy as i32 + g.ph - r as i32 * g.dh, (oy as i32) * g.sh);
                            assert!(r < g.kh && oy < g.oh);
                            let mut m0 = 0;
                            while m0 < nm {
                                let v: Vec<usize> = (0..SGROUP)
                                    .filter(|k| m0 + k < nm)
                                    .map(|k| {
                                        let m = m0 + k;
                                        let (s, ox) = (sk + m * g.sstep, so - m * g.d_dox.d);
                                        assert_eq!(
                                            ix as i32 + g.pw - s as i32 * g.dw,
                                            (ox as i32) * g.sw
                                        );
                                        assert!(s < g.kw && ox < g.ow);
                                        cb + row.wrapping_add(m.wrapping_mul(dm)) as usize * u
                                    })
                                    .collect();
                                for at in v {
                                    for (k, a) in acc.iter_mut().enumerate() {
                                        *a += cols[at + k];
                                    }
                                }
                                m0 += SGROUP;
                            }
                            row = row.wrapping_add(da);
                        }
                        let add = g.flags & COL2IM_ADD != 0;
                        for (k, a) in acc.iter().enumerate() {
                            let old = &mut x[xb + e as usize * u + k];
                            *old = if add { *old + *a } else { *a };
                        }
                        b += l.grid.1;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::conv as r;
    use TensorFormat::{Nchw, Nhwc};

    #[test]
    fn fast_division_is_exact_below_2_pow_31() {
        let mut divisors: Vec<u32> = (1..=3000).collect();
        for k in 1..31 {
            let p = 1u32 << k;
            divisors.extend([p - 1, p, p + 1]);
        }
        divisors.extend([
            3136,
            50_176,
            12_544,
            4608,
            (1 << 31) - 1,
            (1 << 30) + 7,
            1_000_003,
        ]);
        let mut seed = 0x1234_5678_9abc_def0u64;
        for &d in &divisors {
            let f = FastDiv::new(d);
            assert_eq!(f.d, d);
            let mut ns = vec![0u32, 1, d - 1, d, d.saturating_add(1), (1 << 31) - 1];
            for k in [2u32, 3, 7, 1000, 65_537] {
                if let Some(m) = d.checked_mul(k) {
                    if m < 1 << 31 {
                        ns.extend([m - 1, m, m + 1]);
                    }
                }
            }
            for _ in 0..64 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                ns.push((seed as u32) & 0x7fff_ffff);
            }
            for n in ns.into_iter().filter(|&n| n < 1 << 31) {
                assert_eq!(f.div(n), n / d, "{n} / {d} ({f:?})");
            }
        }
        assert_eq!(FastDiv::new(0), FastDiv::new(1));
        assert_eq!(FastDiv::new(1).div(12345), 12345);
    }

    #[test]
    fn col_geom_matches_the_kernel_layout() {
        // kernels/im2col.cu: static_assert(sizeof(ColGeom) == 328); field order as declared.
        assert_eq!(std::mem::size_of::<FastDiv>(), 12);
        assert_eq!(std::mem::size_of::<ColGeom>(), 328);
        assert_eq!(std::mem::align_of::<ColGeom>(), 8);
        let g = ColGeom::default();
        let base = &g as *const ColGeom as usize;
        assert_eq!(&g.count as *const u32 as usize - base, 24);
        assert_eq!(&g.tgroup as *const u32 as usize - base, 92);
        assert_eq!(&g.sstep as *const u32 as usize - base, 100);
        assert_eq!(&g.flags as *const u32 as usize - base, 104);
        assert_eq!(&g.sh as *const i32 as usize - base, 112);
        assert_eq!(&g.d_ow as *const FastDiv as usize - base, 136);
        assert_eq!(&g.d_sw as *const FastDiv as usize - base, 220);
        assert_eq!(&g.d_kw as *const FastDiv as usize - base, 256);
        assert_eq!(&g.d_rowvec as *const FastDiv as usize - base, 268);
        assert_eq!(&g.d_dox as *const FastDiv as usize - base, 316);
    }

    #[test]
    fn every_kernel_name_is_in_the_compiled_file() {
        if !crate::kernels::nvrtc_present() {
            eprintln!("skipping: NVRTC not found");
            return;
        }
        let image = crate::kernels::compile(&crate::kernels::IM2COL, "compute_90").unwrap();
        let ptx = String::from_utf8_lossy(image.bytes()).into_owned();
        for k in KERNELS {
            assert!(
                ptx.contains(&format!(".entry {k}(")),
                "{k} missing from im2col.cu"
            );
        }
    }

    fn shape(format: TensorFormat, n: usize, c: usize, h: usize, w: usize) -> ConvShape {
        ConvShape {
            n,
            c_in: c,
            h,
            w,
            c_out: 4,
            kh: 3,
            kw: 3,
            stride: (1, 1),
            pad: (1, 1),
            dilation: (1, 1),
            format,
        }
    }

    #[test]
    fn copy_units_follow_channels_and_alignment() {
        // NCHW: always single elements.
        assert_eq!(copy_unit_bytes(Nchw, 64, 2, &[0, 0]), 2);
        // NHWC f16: 64 channels = 128 bytes a run: 16-byte units when aligned.
        assert_eq!(copy_unit_bytes(Nhwc, 64, 2, &[256, 512]), 16);
        assert_eq!(copy_unit_bytes(Nhwc, 64, 2, &[256 + 8, 512]), 8);
        assert_eq!(copy_unit_bytes(Nhwc, 64, 2, &[256 + 2, 512]), 2);
        // 12 channels of f16 = 24 bytes: 8-byte units; 3 channels: scalar.
        assert_eq!(copy_unit_bytes(Nhwc, 12, 2, &[0, 0]), 8);
        assert_eq!(copy_unit_bytes(Nhwc, 3, 2, &[0, 0]), 2);
        assert_eq!(copy_unit_bytes(Nhwc, 6, 2, &[0, 0]), 4);
        // f32: 4 channels = 16 bytes; 2 channels = 8; odd: 4 (the element).
        assert_eq!(copy_unit_bytes(Nhwc, 4, 4, &[0, 0]), 16);
        assert_eq!(copy_unit_bytes(Nhwc, 2, 4, &[0, 0]), 8);
        assert_eq!(copy_unit_bytes(Nhwc, 3, 4, &[0, 0]), 4);
        assert_eq!(col2im_unit_bytes(Nhwc, 8, 2, &[0, 16]), 16);
        assert_eq!(col2im_unit_bytes(Nhwc, 8, 2, &[0, 18]), 2);
        assert_eq!(col2im_unit_bytes(Nhwc, 6, 2, &[0, 16]), 4);
        assert_eq!(col2im_unit_bytes(Nhwc, 4, 2, &[0, 8]), 8);
        assert_eq!(col2im_unit_bytes(Nchw, 64, 2, &[0, 0]), 2);
        assert_eq!(col2im_unit_bytes(Nhwc, 4, 4, &[0, 0]), 16);
        assert_eq!(col2im_unit_bytes(Nhwc, 3, 4, &[0, 0]), 4);
    }

    #[test]
    fn grids_cover_every_item_and_image() {
        let s = shape(Nchw, 70_000, 64, 56, 56);
        let l = im2col(&s, ColLayout::standard(3136, 576), 4, 70_000, 0, 0).unwrap();
        assert_eq!(l.kernel, "im2col_nchw_b4");
        assert_eq!(l.geom.count, 16 * 3136, "a thread per pixel of 4 channels");
        assert_eq!(l.grid.0, (16 * 3136u32).div_ceil(THREADS));
        assert_eq!(l.grid.1, MAX_GRID_Y, "images beyond 65535 are strided over");
        assert_eq!(l.grid.2, 3, "9 taps in groups of 4");
        assert_eq!(l.images, 70_000);
        assert_eq!(l.geom.flags & NCHW_OFFSETS_32, NCHW_OFFSETS_32);
        // The filter gradient's [K][chunk][P] layout of a big chunk: offsets past 2^32.
        let wide = ColLayout {
            img: 3136,
            row: 3136 * 4000,
        };
        let l = im2col(&shape(Nchw, 4000, 64, 56, 56), wide, 4, 4000, 0, 0).unwrap();
        assert_eq!(
            l.geom.flags & NCHW_OFFSETS_32,
            0,
            "576 * 3136 * 4000 > 2^32"
        );
        // A huge filter: groups grow so that gridDim.z stays within its limit.
        let mut big = shape(Nchw, 1, 1, 600, 600);
        (big.kh, big.kw, big.pad) = (600, 600, (0, 0));
        let l = im2col(&big, ColLayout::standard(1, 360_000), 4, 1, 0, 0).unwrap();
        assert!(l.grid.2 <= MAX_GRID_Y && l.geom.tgroup % 2 == 0, "{l:?}");
        assert!(l.grid.2 * l.geom.tgroup >= 360_000);
        let l = im2col(
            &shape(Nhwc, 3, 64, 56, 56),
            ColLayout::standard(3136, 576),
            2,
            3,
            0,
            0,
        )
        .unwrap();
        assert_eq!((l.kernel, l.unit, l.geom.taps), ("im2col_nhwc_b16", 8, 72));
        assert_eq!(l.geom.count, 3136 * 72);
        assert_eq!(l.grid, ((3136 * 72u32).div_ceil(2 * THREADS), 3, 1));
        // The stem: shared-memory rows, a whole output row (112 pixels) per block.
        let mut stem = shape(Nhwc, 32, 3, 224, 224);
        (stem.kh, stem.kw, stem.stride, stem.pad) = (7, 7, (2, 2), (3, 3));
        let l = im2col(&stem, ColLayout::standard(12_544, 147), 2, 32, 0, 0).unwrap();
        assert_eq!(l.kernel, "im2col_nhwc_rows_b2");
        assert_eq!((l.geom.tw, l.geom.tiles, l.geom.rowlen), (112, 1, 229 * 3));
        // Rows 704 elements apart (687 + 15 rounded up to 8; 224*3 = 0 mod 8), 7 of them.
        assert_eq!((l.geom.rstride, l.geom.d_rowvec.d), (704, 87));
        assert_eq!(l.smem, 7 * 704 * 2);
        assert_eq!(l.grid, (112, 32, 1));
        let l = im2col(&stem, ColLayout::standard(12_544, 147), 4, 32, 0, 0).unwrap();
        assert_eq!(l.kernel, "im2col_nhwc_rows_b4");
        assert_eq!(
            (l.geom.tw, l.geom.tiles),
            (56, 2),
            "32 KiB of output a block"
        );
        let l = col2im(&shape(Nhwc, 3, 64, 7, 7), DType::F16, 3, 0, 0, false).unwrap();
        assert_eq!((l.kernel, l.unit), ("col2im_nhwc_v16_f16", 8));
        assert_eq!(l.geom.count, 7 * 7 * 8);
        assert_eq!(l.geom.c_in, 8);
        assert_eq!(l.geom.taps, 9 * 8);
        assert_eq!(l.grid, (2, 3, 1), "an item per thread");
        assert_eq!(l.config().block_dim, (THREADS, 1, 1));
        let l = col2im(&shape(Nhwc, 3, 6, 7, 7), DType::BF16, 3, 0, 0, false).unwrap();
        assert_eq!((l.kernel, l.unit), ("col2im_nhwc_v4_bf16", 2));
    }

    /// The rows kernel's tiling: its shared memory within the budget, at least one pixel, and
    /// `None` exactly where the kernel does not apply.
    #[test]
    fn rows_tiling_respects_its_conditions() {
        let mut s = shape(Nhwc, 1, 3, 9, 240);
        (s.kh, s.kw, s.stride, s.pad) = (7, 7, (2, 2), (3, 3));
        let t = rows_tiling(&s, 2).unwrap();
        assert_eq!(
            (t.tw, t.tiles),
            (60, 2),
            "ow = 120 split in two balanced tiles"
        );
        assert_eq!(t.rowlen, (59 * 2 + 7) * 3);
        assert_eq!((t.rstride, t.rowvecs, t.smem), (392, 48, 7 * 392 * 2));
        // Rows whose x addresses step by a non-multiple of 16 bytes: the stride follows.
        s.w = 241; // 723 elements a row, 3 mod 8
        let t = rows_tiling(&s, 2).unwrap();
        assert_eq!((t.rstride % 8, t.rstride >= t.rowlen + 15), (3, true));
        assert_eq!(t.smem, (7 * t.rstride).div_ceil(8) * 16);
        // Limited by shared memory: 3 rows of (tw-1)*5 + 2 columns of 65 f32 channels.
        let mut s = shape(Nhwc, 1, 65, 4, 60);
        (s.kh, s.kw, s.stride, s.pad) = (3, 2, (1, 5), (1, 0));
        let t = rows_tiling(&s, 4).unwrap();
        assert_eq!((t.tw, t.tiles, t.rowlen), (6, 2, (5 * 5 + 2) * 65));
        assert!(t.smem as usize <= ROWS_SMEM_MAX);
        // Not applicable: NCHW, dilation along the width, rows under 16 bytes, too big.
        assert!(rows_tiling(&shape(Nchw, 1, 3, 9, 9), 2).is_none());
        let mut d = shape(Nhwc, 1, 3, 9, 9);
        d.dilation = (1, 2);
        assert!(rows_tiling(&d, 2).is_none());
        assert!(
            rows_tiling(&shape(Nhwc, 1, 1, 9, 9), 4).is_none(),
            "3 f32 a row"
        );
        assert!(
            rows_tiling(&shape(Nhwc, 1, 2, 9, 9), 4).is_some(),
            "6 f32 a row"
        );
        assert!(rows_tiling(&shape(Nhwc, 1, 1101, 3, 3), 4).is_none());
        let l = im2col(
            &shape(Nhwc, 1, 1101, 3, 3),
            ColLayout::standard(9, 9909),
            4,
            1,
            0,
            0,
        )
        .unwrap();
        assert_eq!(l.kernel, "im2col_nhwc_b4", "the flat fallback");
        // Vector units of 8 bytes or more keep the flat kernel.
        let l = im2col(
            &shape(Nhwc, 1, 4, 9, 9),
            ColLayout::standard(81, 36),
            2,
            1,
            0,
            0,
        )
        .unwrap();
        assert_eq!(l.kernel, "im2col_nhwc_b8");
        let l = im2col(
            &shape(Nhwc, 1, 4, 9, 9),
            ColLayout::standard(81, 36),
            2,
            1,
            2,
            0,
        )
        .unwrap();
        assert_eq!(
            l.kernel, "im2col_nhwc_rows_b2",
            "misaligned x: no 8-byte units"
        );
    }

    /// Over many widths, strides, dilations and channel counts: every block of the rows kernel
    /// has at least one pixel, the blocks cover the output row, the tile fits the budget, holds
    /// what the block's last pixel reads, and its rows keep x's 16-byte alignment and never
    /// share a vector.
    #[test]
    fn rows_tiles_cover_the_output_row() {
        let mut seen_split = false;
        for c_in in [1usize, 3, 5, 17, 129, 700] {
            for kw in [1usize, 2, 3, 7] {
                for (sw, dh) in [(1usize, 1usize), (2, 1), (3, 2), (1, 3)] {
                    for w in [1usize, 2, 7, 56, 113, 224, 1000, 4099] {
                        let mut s = shape(Nhwc, 1, c_in, 9, w);
                        (s.kw, s.stride, s.pad, s.dilation) = (kw, (1, sw), (1, kw / 2), (dh, 1));
                        let Ok((_, ow)) = s.out_hw() else { continue };
                        for elem in [2usize, 4] {
                            let Some(t) = rows_tiling(&s, elem) else {
                                continue;
                            };
                            let v = 16 / elem;
                            let (tw, tiles) = (t.tw as usize, t.tiles as usize);
                            let (rowlen, rstride) = (t.rowlen as usize, t.rstride as usize);
                            assert!(
                                tw >= 1 && (tiles - 1) * tw < ow && tiles * tw >= ow,
                                "{s:?}"
                            );
                            assert!(t.smem as usize <= ROWS_SMEM_MAX, "{s:?}");
                            assert_eq!(t.smem as usize, (s.kh * rstride).div_ceil(v) * 16);
                            // The block's last pixel reads up to (tw-1)*sw + kw - 1 columns on.
                            assert_eq!(((tw - 1) * sw + kw) * c_in, rowlen, "{s:?}");
                            assert!(rstride >= rowlen + 2 * v - 1, "{s:?}");
                            assert_eq!(rstride % v, dh * w * c_in % v, "{s:?}");
                            assert_eq!(t.rowvecs as usize, (rowlen + v - 1).div_ceil(v));
                            seen_split |= tiles > 1;
                        }
                    }
                }
            }
        }
        assert!(seen_split);
    }

    #[test]
    fn oversized_problems_are_not_supported() {
        // One image's columns at 2^31 elements or more.
        let s = shape(Nchw, 1, 1 << 12, 1 << 10, 1 << 10);
        assert!(matches!(
            im2col(&s, ColLayout::standard(1 << 20, 9 << 12), 2, 1, 0, 0),
            Err(Error::NotSupported(_))
        ));
        let mut s = shape(Nchw, 1, 1, 5, 5);
        s.pad = (usize::MAX / 4, 1);
        assert!(geometry(&s, ColLayout::standard(1, 1), 1).is_err());
        // A channel count that is not a whole number of units.
        assert!(matches!(
            geometry(&shape(Nhwc, 1, 3, 5, 5), ColLayout::standard(25, 27), 2),
            Err(Error::NotSupported(_))
        ));
    }

    use crate::testutil::xorshift_values as values;

    /// Problems for the emulation tests: odd sizes, strides, dilations, asymmetric padding,
    /// channel counts that do and do not fill copy units.
    pub(crate) fn problems() -> Vec<ConvShape> {
        let mut v = Vec::new();
        for format in [Nchw, Nhwc] {
            for (c_in, h, w) in [(1, 5, 7), (3, 9, 6), (8, 4, 4), (16, 3, 5), (12, 7, 7)] {
                for (kh, kw, stride, pad, dilation) in [
                    (3, 3, (1, 1), (1, 1), (1, 1)),
                    (1, 1, (1, 1), (0, 0), (1, 1)),
                    (1, 1, (2, 2), (0, 0), (1, 1)),
                    (3, 2, (2, 1), (0, 2), (1, 2)),
                    (2, 3, (1, 3), (2, 0), (2, 1)),
                    (5, 5, (2, 2), (2, 2), (1, 1)),
                    (3, 3, (1, 1), (0, 0), (2, 2)),
                    // Stride and dilation sharing a factor: only every other input index is
                    // reached, by every tap of a residue class.
                    (3, 3, (2, 2), (1, 2), (2, 2)),
                    (3, 2, (4, 3), (5, 1), (6, 2)),
                ] {
                    let s = ConvShape {
                        n: 3,
                        c_in,
                        h,
                        w,
                        c_out: 5,
                        kh,
                        kw,
                        stride,
                        pad,
                        dilation,
                        format,
                    };
                    if s.out_hw().is_ok() {
                        v.push(s);
                    }
                }
            }
        }
        // The rows kernel's cases (NHWC; NCHW too for coverage of the same shapes): a stem
        // split into two tiles per output row, padding on either side only, a tiling limited
        // by shared memory, odd channel counts, and a problem too big for it (flat fallback).
        for format in [Nchw, Nhwc] {
            for (c_in, (h, w), (kh, kw), stride, pad) in [
                (3, (9, 240), (7, 7), (2, 2), (3, 3)),
                (5, (6, 11), (3, 4), (1, 1), (0, 3)),
                (5, (6, 11), (2, 5), (2, 1), (1, 0)),
                (65, (4, 60), (3, 2), (1, 5), (1, 0)),
                (7, (5, 30), (1, 3), (1, 2), (0, 1)),
                (1101, (3, 3), (3, 3), (1, 1), (1, 1)),
            ] {
                v.push(ConvShape {
                    n: 3,
                    c_in,
                    h,
                    w,
                    c_out: 2,
                    kh,
                    kw,
                    stride,
                    pad,
                    dilation: (1, 1),
                    format,
                });
            }
        }
        v
    }

    /// The emulated im2col kernels (every copy unit, every alignment case of x and of the
    /// columns) reproduce the reference's columns exactly, for a chunk of images starting past
    /// image 0 and with the filter gradient's `[K][chunk][P]` NCHW layout; no element is left
    /// unwritten, no load leaves x.
    #[test]
    fn emulated_im2col_equals_the_reference() {
        let mut cases = 0;
        let mut kernels = std::collections::BTreeSet::new();
        for s in problems() {
            let (oh, ow) = s.out_hw().unwrap();
            let (pixels, taps) = (oh * ow, s.c_in * s.kh * s.kw);
            let x = values(cases + 1, s.x_len().unwrap());
            let want = r::im2col(&s, &x).unwrap();
            for elem in [2usize, 4] {
                for (x_addr, c_addr) in [(0u64, 0u64), (2, 0), (4, 4), (8, 8), (0, 2), (4, 12)] {
                    if x_addr % elem as u64 != 0 || c_addr % elem as u64 != 0 {
                        continue;
                    }
                    // Images 1..3 of the batch (a chunk with an offset).
                    let (b0, nb) = (1, 2);
                    let l = im2col(
                        &s,
                        ColLayout::standard(pixels, taps),
                        elem,
                        nb,
                        x_addr,
                        c_addr,
                    )
                    .unwrap();
                    kernels.insert(l.kernel);
                    let mut cols = vec![f64::NAN; nb * pixels * taps];
                    let x_img = s.c_in * s.h * s.w;
                    emulate::im2col(&l, &x[b0 * x_img..(b0 + nb) * x_img], &mut cols);
                    let part = &want[b0 * pixels * taps..(b0 + nb) * pixels * taps];
                    for (i, (g, w)) in cols.iter().zip(part).enumerate() {
                        assert!(
                            g == w,
                            "{s:?} {} elem {elem} x@{x_addr} cols@{c_addr}: col {i}: {g} vs {w}",
                            l.kernel
                        );
                    }
                    cases += 1;
                }
            }
            if s.format == Nchw {
                // [K][chunk][P]: image b's row q at q*chunk*P + b*P.
                let n = s.n;
                let layout = ColLayout {
                    img: pixels,
                    row: n * pixels,
                };
                let l = im2col(&s, layout, 4, n, 0, 0).unwrap();
                let mut cols = vec![f64::NAN; n * pixels * taps];
                emulate::im2col(&l, &x, &mut cols);
                for b in 0..n {
                    for q in 0..taps {
                        for p in 0..pixels {
                            assert_eq!(
                                cols[q * n * pixels + b * pixels + p],
                                want[(b * taps + q) * pixels + p],
                                "{s:?} [K][n][P] b {b} q {q} p {p}"
                            );
                        }
                    }
                }
            }
        }
        assert!(cases > 300, "{cases}");
        let im2col_kernels: Vec<_> = KERNELS.iter().filter(|k| k.starts_with("im2col")).collect();
        for k in im2col_kernels {
            assert!(kernels.contains(k), "{k} never emulated: {kernels:?}");
        }
    }

    /// The emulated col2im kernels (scalar, 4-, 8- and 16-byte units) equal the reference col2im.
    #[test]
    fn emulated_col2im_equals_the_reference() {
        let mut cases = 0;
        let mut kernels = std::collections::BTreeSet::new();
        for s in problems() {
            let (oh, ow) = s.out_hw().unwrap();
            let (pixels, taps) = (oh * ow, s.c_in * s.kh * s.kw);
            let cols = values(cases + 77, s.n * pixels * taps);
            let want = r::col2im(&s, &cols).unwrap();
            for dtype in DType::ALL {
                for addr in [0u64, 2, 4, 8] {
                    if addr % dtype.size() as u64 != 0 {
                        continue;
                    }
                    let l = col2im(&s, dtype, s.n, 0, addr, false).unwrap();
                    kernels.insert(l.kernel);
                    let mut x = vec![f64::NAN; s.x_len().unwrap()];
                    emulate::col2im(&l, &cols, &mut x);
                    for (i, (g, w)) in x.iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() <= 1e-12,
                            "{s:?} {} @{addr}: x[{i}] {g} vs {w}",
                            l.kernel
                        );
                    }
                    cases += 1;
                }
            }
        }
        assert!(cases > 300, "{cases}");
        for k in KERNELS.iter().filter(|k| k.starts_with("col2im")) {
            assert!(kernels.contains(k), "{k} never emulated: {kernels:?}");
        }
    }
}
