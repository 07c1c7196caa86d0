//! Launch arithmetic of `kernels/im2col.cu`: the kernels' geometry argument ([`ColGeom`], with
//! magic-number divisors, [`FastDiv`]), the choice of kernel (copy unit, vector col2im) and the
//! grid. Pure: no GPU. The tests emulate the kernels' index math on the CPU, thread by thread,
//! and compare with [`crate::reference::conv`].

use cudarc::driver::{DeviceRepr, LaunchConfig};

use crate::conv::ConvShape;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::TensorFormat;

/// Threads per block of every kernel in `kernels/im2col.cu` (`THREADS` there).
pub(crate) const THREADS: u32 = 256;
/// Work items per thread of the im2col and col2im kernels (`EPT` there).
pub(crate) const EPT: u32 = 4;
/// Largest `gridDim.y`; the kernels stride over further images.
pub(crate) const MAX_GRID_Y: u32 = 65_535;
/// Per-image item counts, extents and index sums stay at or below this: the kernels index an
/// image's items in 32 bits, [`FastDiv`] is exact below 2^31, and coordinates are `int`.
pub(crate) const MAX_EXTENT: usize = i32::MAX as usize;

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
/// `kernels/im2col.cu` (200 bytes; `static_assert`ed there, tested here). "Units" are elements,
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
    /// Work items (threads) per image: NCHW im2col `c_in * P`, col2im x's units per image;
    /// unused by NHWC im2col (one warp per pixel).
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
    /// Padding to the kernel's layout.
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

/// The geometry of `s` with NHWC channels grouped in units of `unit` elements (1 for NCHW and
/// the scalar kernels); `count` is left 0 for the caller to set.
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
    })
}

/// One launch of an im2col/col2im kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Launch {
    /// The kernel's name in `kernels/im2col.cu`.
    pub kernel: &'static str,
    /// `(gridDim.x, gridDim.y)`; blocks of [`THREADS`].
    pub grid: (u32, u32),
    /// The geometry argument.
    pub geom: ColGeom,
    /// Images of the chunk (the kernels' `images` argument).
    pub images: u32,
    /// Elements each work item moves (the copy unit: 1, or channels per 16-byte unit).
    pub unit: usize,
}

impl Launch {
    /// As cudarc's launch configuration.
    pub(crate) fn config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.grid.0, self.grid.1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
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
    let unit = unit_bytes / elem;
    let mut geom = geometry(s, layout, unit)?;
    // NCHW: a thread per (c, pixel); NHWC: a warp per pixel. Both counts were checked in
    // geometry() (c_in*P <= c_in*kh*kw*P).
    let blocks = match s.format {
        TensorFormat::Nchw => {
            geom.count = geom.c_in * geom.pixels;
            geom.count.div_ceil(THREADS)
        }
        TensorFormat::Nhwc => geom.pixels.div_ceil(THREADS / 32),
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
    let (grid, images) = grid_for(blocks, images)?;
    Ok(Launch {
        kernel,
        grid,
        geom,
        images,
        unit,
    })
}

/// Whether col2im takes its 16-byte path: NHWC, a tap's channel run a whole number of 16-byte
/// units, both addresses 16-byte aligned.
pub(crate) fn col2im_vector(format: TensorFormat, c_in: usize, elem: usize, ptrs: &[u64]) -> bool {
    format == TensorFormat::Nhwc && (c_in * elem) % 16 == 0 && ptrs.iter().all(|&p| p % 16 == 0)
}

/// The col2im launch for `images` images of `s`: columns in the reference layout at
/// `cols_addr`, the input gradient at `x_addr`.
pub(crate) fn col2im(
    s: &ConvShape,
    dtype: DType,
    images: usize,
    cols_addr: u64,
    x_addr: u64,
) -> Result<Launch> {
    let elem = dtype.size();
    let vector = col2im_vector(s.format, s.c_in, elem, &[cols_addr, x_addr]);
    let unit = if vector { 16 / elem } else { 1 };
    let (oh, ow) = s.out_hw()?;
    let layout = ColLayout::standard(oh * ow, s.c_in * s.kh * s.kw);
    let mut geom = geometry(s, layout, unit)?;
    geom.count = geom.c_in * geom.h * geom.w; // c_in*h*w (in units) was checked in geometry()
    let blocks = geom.count.div_ceil(THREADS * EPT);
    let kernel = match (s.format, vector, dtype) {
        (TensorFormat::Nchw, _, DType::F32) => "col2im_nchw_f32",
        (TensorFormat::Nchw, _, DType::F16) => "col2im_nchw_f16",
        (TensorFormat::Nchw, _, DType::BF16) => "col2im_nchw_bf16",
        (TensorFormat::Nhwc, false, DType::F32) => "col2im_nhwc_f32",
        (TensorFormat::Nhwc, false, DType::F16) => "col2im_nhwc_f16",
        (TensorFormat::Nhwc, false, DType::BF16) => "col2im_nhwc_bf16",
        (TensorFormat::Nhwc, true, DType::F32) => "col2im_nhwc_vec_f32",
        (TensorFormat::Nhwc, true, DType::F16) => "col2im_nhwc_vec_f16",
        (TensorFormat::Nhwc, true, DType::BF16) => "col2im_nhwc_vec_bf16",
    };
    let (grid, images) = grid_for(blocks, images)?;
    Ok(Launch {
        kernel,
        grid,
        geom,
        images,
        unit,
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
    "col2im_nchw_f32",
    "col2im_nchw_f16",
    "col2im_nchw_bf16",
    "col2im_nhwc_f32",
    "col2im_nhwc_f16",
    "col2im_nhwc_bf16",
    "col2im_nhwc_vec_f32",
    "col2im_nhwc_vec_f16",
    "col2im_nhwc_vec_bf16",
    "conv_accumulate_f32",
    "conv_accumulate_f16",
    "conv_accumulate_bf16",
];

/// CPU emulations of the kernels, statement for statement, over the whole grid (every block,
/// every thread, every work item), on f64 buffers indexed in elements.
#[cfg(test)]
pub(crate) mod emulate {
    use super::*;

    /// `im2col_nchw` / `im2col_nhwc` of `kernels/im2col.cu` (the kernel is chosen by the
    /// launch's name; each work item moves `l.unit` elements).
    pub(crate) fn im2col(l: &Launch, x: &[f64], cols: &mut [f64]) {
        let g = &l.geom;
        let u = l.unit;
        let mut copy = |cols_at: u64, x_at: Option<u64>| {
            for k in 0..u {
                cols[cols_at as usize * u + k] = match x_at {
                    Some(i) => x[i as usize * u + k],
                    None => 0.0,
                };
            }
        };
        for by in 0..l.grid.1 {
            for bx in 0..l.grid.0 {
                for t in 0..THREADS {
                    if l.kernel.starts_with("im2col_nchw") {
                        let e = bx * THREADS + t;
                        if e >= g.count {
                            continue;
                        }
                        let c = g.d_pixels.div(e);
                        let p = e - c * g.pixels;
                        let oy = g.d_ow.div(p);
                        let ox = p - oy * g.ow;
                        let iy0 = oy as i32 * g.sh - g.ph;
                        let ix0 = ox as i32 * g.sw - g.pw;
                        let mut b = by;
                        while b < l.images {
                            let plane = u64::from(b) * g.x_img + u64::from(c * g.h * g.w);
                            let mut dst = u64::from(b) * g.col_img
                                + u64::from(c * g.khkw) * g.col_row
                                + u64::from(p);
                            let (mut iy, mut ix, mut s) = (iy0, ix0, 0u32);
                            // tap_value + the odometer of the kernel, one tap.
                            let tap = |iy: &mut i32, ix: &mut i32, s: &mut u32| {
                                let inside = (*iy as u32) < g.h && (*ix as u32) < g.w;
                                let at = (*iy as u32).wrapping_mul(g.w).wrapping_add(*ix as u32);
                                let v = inside.then(|| plane + u64::from(at));
                                *ix += g.dw;
                                *s += 1;
                                if *s == g.kw {
                                    *s = 0;
                                    *ix = ix0;
                                    *iy += g.dh;
                                }
                                v
                            };
                            let mut t = 0;
                            while t + EPT <= g.khkw {
                                let v: Vec<_> =
                                    (0..EPT).map(|_| tap(&mut iy, &mut ix, &mut s)).collect();
                                for vj in v {
                                    copy(dst, vj);
                                    dst += g.col_row;
                                }
                                t += EPT;
                            }
                            while t < g.khkw {
                                let v = tap(&mut iy, &mut ix, &mut s);
                                copy(dst, v);
                                dst += g.col_row;
                                t += 1;
                            }
                            b += l.grid.1;
                        }
                    } else {
                        let lane = t & 31;
                        let first = bx * (THREADS / 32) + (t >> 5);
                        let mut b = by;
                        while b < l.images {
                            let xb = u64::from(b) * g.x_img;
                            let cb = u64::from(b) * g.col_img;
                            let mut p = first;
                            while p < g.pixels {
                                let oy = g.d_ow.div(p);
                                let ox = p - oy * g.ow;
                                let iy0 = oy as i32 * g.sh - g.ph;
                                let ix0 = ox as i32 * g.sw - g.pw;
                                let row = cb + u64::from(p) * u64::from(g.taps);
                                let mut q0 = 0;
                                while q0 < g.taps {
                                    for j in 0..EPT {
                                        let q_in = q0 + j * 32 + lane;
                                        // The kernel loads at the clamped item and stores only in range.
                                        let q = q_in.min(g.taps - 1);
                                        let r = g.d_kwc.div(q);
                                        let jj = q - r * g.kwc;
                                        let iy = iy0 + r as i32 * g.dh;
                                        let mut src = None;
                                        if (iy as u32) < g.h {
                                            if g.dw == 1 {
                                                let xc = ix0 * g.c_in as i32 + jj as i32;
                                                if (xc as u32) < g.wc {
                                                    src = Some(
                                                        xb + iy as u64 * u64::from(g.wc)
                                                            + xc as u64,
                                                    );
                                                }
                                            } else {
                                                let s = g.d_cin.div(jj);
                                                let c = jj - s * g.c_in;
                                                let ix = ix0 + s as i32 * g.dw;
                                                if (ix as u32) < g.w {
                                                    src = Some(
                                                        xb + (iy as u64 * u64::from(g.w)
                                                            + ix as u64)
                                                            * u64::from(g.c_in)
                                                            + u64::from(c),
                                                    );
                                                }
                                            }
                                        }
                                        if q_in < g.taps {
                                            copy(row + u64::from(q), src);
                                        }
                                    }
                                    q0 += 32 * EPT;
                                }
                                p += l.grid.0 * (THREADS / 32);
                            }
                            b += l.grid.1;
                        }
                    }
                }
            }
        }
    }

    fn out_of(t: i32, stride: i32, ds: FastDiv, out: u32) -> Option<u32> {
        if stride == 1 {
            return ((t as u32) < out).then_some(t as u32);
        }
        let o = ds.div(t as u32);
        (o.wrapping_mul(stride as u32) as i32 == t && o < out).then_some(o)
    }

    /// `col2im_nchw` / `col2im_nhwc` / `col2im_nhwc_vec` of `kernels/im2col.cu`, summing in
    /// f64 in the kernel's order.
    pub(crate) fn col2im(l: &Launch, cols: &[f64], x: &mut [f64]) {
        let g = &l.geom;
        let u = l.unit;
        let nchw = l.kernel.starts_with("col2im_nchw");
        for by in 0..l.grid.1 {
            for bx in 0..l.grid.0 {
                for t in 0..THREADS {
                    let first = bx * (THREADS * EPT) + t;
                    let mut b = by;
                    while b < l.images {
                        let cb = b as usize * g.col_img as usize * u;
                        let xb = b as usize * g.x_img as usize * u;
                        for j in 0..EPT {
                            let e = first + j * THREADS;
                            if e >= g.count {
                                break;
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
                            let mut acc = vec![0.0; u];
                            for r in 0..g.kh {
                                let ty = iy as i32 + g.ph - r as i32 * g.dh;
                                if ty < 0 {
                                    break;
                                }
                                let Some(oy) = out_of(ty, g.sh, g.d_sh, g.oh) else {
                                    continue;
                                };
                                for s in 0..g.kw {
                                    let tx = ix as i32 + g.pw - s as i32 * g.dw;
                                    if tx < 0 {
                                        break;
                                    }
                                    let Some(ox) = out_of(tx, g.sw, g.d_sw, g.ow) else {
                                        continue;
                                    };
                                    let at = if nchw {
                                        let q = (c * g.kh + r) * g.kw + s;
                                        q as u64 * g.col_row + (oy * g.ow + ox) as u64
                                    } else {
                                        (oy * g.ow + ox) as u64 * g.taps as u64
                                            + ((r * g.kw + s) * g.c_in + c) as u64
                                    };
                                    for (k, a) in acc.iter_mut().enumerate() {
                                        *a += cols[cb + at as usize * u + k];
                                    }
                                }
                            }
                            for (k, a) in acc.iter().enumerate() {
                                x[xb + e as usize * u + k] = *a;
                            }
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
        // kernels/im2col.cu: static_assert(sizeof(ColGeom) == 200); field order as declared.
        assert_eq!(std::mem::size_of::<FastDiv>(), 12);
        assert_eq!(std::mem::size_of::<ColGeom>(), 200);
        assert_eq!(std::mem::align_of::<ColGeom>(), 8);
        let g = ColGeom::default();
        let base = &g as *const ColGeom as usize;
        assert_eq!(&g.count as *const u32 as usize - base, 24);
        assert_eq!(&g.sh as *const i32 as usize - base, 80);
        assert_eq!(&g.d_ow as *const FastDiv as usize - base, 104);
        assert_eq!(&g.d_sw as *const FastDiv as usize - base, 188);
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
        assert!(col2im_vector(Nhwc, 8, 2, &[0, 16]));
        assert!(!col2im_vector(Nhwc, 8, 2, &[0, 18]));
        assert!(!col2im_vector(Nhwc, 6, 2, &[0, 16]));
        assert!(!col2im_vector(Nchw, 64, 2, &[0, 0]));
        assert!(col2im_vector(Nhwc, 4, 4, &[0, 0]));
    }

    #[test]
    fn grids_cover_every_item_and_image() {
        let s = shape(Nchw, 70_000, 64, 56, 56);
        let l = im2col(&s, ColLayout::standard(3136, 576), 4, 70_000, 0, 0).unwrap();
        assert_eq!(l.kernel, "im2col_nchw_b4");
        assert_eq!(l.geom.count, 64 * 3136, "a thread per (channel, pixel)");
        assert_eq!(l.grid.0, (64 * 3136u32).div_ceil(THREADS));
        assert_eq!(l.grid.1, MAX_GRID_Y, "images beyond 65535 are strided over");
        assert_eq!(l.images, 70_000);
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
        assert_eq!(l.grid, (3136 / 8, 3), "a warp per pixel");
        let l = col2im(&shape(Nhwc, 3, 64, 7, 7), DType::F16, 3, 0, 0).unwrap();
        assert_eq!((l.kernel, l.unit), ("col2im_nhwc_vec_f16", 8));
        assert_eq!(l.geom.count, 7 * 7 * 8);
        assert_eq!(l.geom.c_in, 8);
        assert_eq!(l.geom.taps, 9 * 8);
        assert_eq!(l.grid, (1, 3));
        assert_eq!(l.config().block_dim, (THREADS, 1, 1));
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

    fn values(seed: u64, n: usize) -> Vec<f64> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
            })
            .collect()
    }

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
        v
    }

    /// The emulated im2col kernel (every copy unit, every alignment case) reproduces the
    /// reference's columns exactly, for a chunk of images starting past image 0 and with the
    /// filter gradient's `[K][chunk][P]` NCHW layout; no element is left unwritten.
    #[test]
    fn emulated_im2col_equals_the_reference() {
        let mut cases = 0;
        for s in problems() {
            let (oh, ow) = s.out_hw().unwrap();
            let (pixels, taps) = (oh * ow, s.c_in * s.kh * s.kw);
            let x = values(cases + 1, s.x_len());
            let want = r::im2col(&s, &x).unwrap();
            for elem in [2usize, 4] {
                for x_addr in [0u64, 2, 4, 8] {
                    if x_addr % elem as u64 != 0 {
                        continue;
                    }
                    // Images 1..3 of the batch (a chunk with an offset).
                    let (b0, nb) = (1, 2);
                    let l =
                        im2col(&s, ColLayout::standard(pixels, taps), elem, nb, x_addr, 0).unwrap();
                    let mut cols = vec![f64::NAN; nb * pixels * taps];
                    let x_img = s.c_in * s.h * s.w;
                    emulate::im2col(&l, &x[b0 * x_img..], &mut cols);
                    let part = &want[b0 * pixels * taps..(b0 + nb) * pixels * taps];
                    for (i, (g, w)) in cols.iter().zip(part).enumerate() {
                        assert!(
                            g == w,
                            "{s:?} {} elem {elem} x@{x_addr}: col {i}: {g} vs {w}",
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
        assert!(cases > 150, "{cases}");
    }

    /// The emulated col2im kernel (scalar and 16-byte unit paths) equals the reference col2im.
    #[test]
    fn emulated_col2im_equals_the_reference() {
        let mut cases = 0;
        for s in problems() {
            let (oh, ow) = s.out_hw().unwrap();
            let (pixels, taps) = (oh * ow, s.c_in * s.kh * s.kw);
            let cols = values(cases + 77, s.n * pixels * taps);
            let want = r::col2im(&s, &cols).unwrap();
            for dtype in DType::ALL {
                for addr in [0u64, 4] {
                    let l = col2im(&s, dtype, s.n, 0, addr).unwrap();
                    let mut x = vec![f64::NAN; s.x_len()];
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
        assert!(cases > 150, "{cases}");
    }
}
