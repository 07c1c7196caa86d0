//! nnfuse's direct convolution kernel (`kernels/conv_direct.cu`): any shape and format, f32
//! accumulation, no workspace. The fallback when nothing else runs, and the reference that the
//! dispatcher's numerical check compares candidates with (its f32-output variant).
//!
//! A block computes 256 consecutive output pixels (flattened over the batch) for 8 output
//! channels; the block's filter taps are staged in shared memory, and each thread sums its taps
//! in the filter's memory order (`c, r, s` for KCRS, `r, s, c` for KRSC) in f32: deterministic,
//! one rounding at the end (none for the f32 output).

use cudarc::driver::{DeviceRepr, LaunchConfig};

use super::call::PathCall;
use super::paths::direct_limits;
use super::{ConvShape, Direction, FwdPtrs};
use crate::context::Context;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels;
use crate::layout::TensorFormat;

/// Output pixels per block (`THREADS` in `kernels/conv_direct.cu`).
const THREADS: u32 = 256;
/// Output channels per block (`KT`).
const KT: usize = 8;
/// Largest `gridDim.x` / `gridDim.y` the launcher asks for (the kernel strides over the rest).
const MAX_GRID_X: u64 = i32::MAX as u64;
const MAX_GRID_Y: usize = 65_535;

/// The kernel's geometry argument, field for field as `DirectGeom` in `kernels/conv_direct.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct DirectGeom {
    pixels: u64,
    x_img: u64,
    c_in: u32,
    h: u32,
    w: u32,
    c_out: u32,
    kh: u32,
    kw: u32,
    oh: u32,
    ow: u32,
    sh: i32,
    sw: i32,
    ph: i32,
    pw: i32,
    dh: i32,
    dw: i32,
    p: u32,
    k: u32,
    groups: u32,
    unused: u32,
}

// SAFETY: plain `repr(C)` data laid out as the kernel's `DirectGeom` (size checked by a test);
// passed by value as a kernel argument.
unsafe impl DeviceRepr for DirectGeom {}

/// The kernel's geometry; refused ([`Error::NotSupported`]) beyond the kernel's 32-bit
/// per-image indices, by the same check the plan's direct rule applies
/// ([`direct_limits`](super::paths::direct_limits)).
fn geometry(s: &ConvShape) -> Result<DirectGeom> {
    let (oh, ow) = s.out_hw()?;
    let y_len = s.y_len()?;
    direct_limits(s, (oh, ow)).map_err(Error::NotSupported)?;
    // Every value below is at most i32::MAX (checked above: each extent is bounded by a
    // checked product or sum of nonzero extents).
    let u = |v: usize| v as u32;
    let i = |v: usize| v as i32;
    Ok(DirectGeom {
        pixels: (y_len / s.c_out) as u64,
        x_img: (s.c_in * s.h * s.w) as u64,
        c_in: u(s.c_in),
        h: u(s.h),
        w: u(s.w),
        c_out: u(s.c_out),
        kh: u(s.kh),
        kw: u(s.kw),
        oh: u(oh),
        ow: u(ow),
        sh: i(s.stride.0),
        sw: i(s.stride.1),
        ph: i(s.pad.0),
        pw: i(s.pad.1),
        dh: i(s.dilation.0),
        dw: i(s.dilation.1),
        p: u(oh * ow),
        k: u(s.c_in * s.kh * s.kw),
        groups: s.c_out.div_ceil(KT) as u32,
        unused: 0,
    })
}

fn kernel_name(format: TensorFormat, dtype: DType, f32_out: bool) -> &'static str {
    use DType::*;
    use TensorFormat::*;
    match (format, dtype, f32_out) {
        (Nchw, F32, false) => "conv_direct_nchw_f32",
        (Nchw, F16, false) => "conv_direct_nchw_f16",
        (Nchw, BF16, false) => "conv_direct_nchw_bf16",
        (Nhwc, F32, false) => "conv_direct_nhwc_f32",
        (Nhwc, F16, false) => "conv_direct_nhwc_f16",
        (Nhwc, BF16, false) => "conv_direct_nhwc_bf16",
        (Nchw, F32, true) => "conv_direct_nchw_f32_f32out",
        (Nchw, F16, true) => "conv_direct_nchw_f16_f32out",
        (Nchw, BF16, true) => "conv_direct_nchw_bf16_f32out",
        (Nhwc, F32, true) => "conv_direct_nhwc_f32_f32out",
        (Nhwc, F16, true) => "conv_direct_nhwc_f16_f32out",
        (Nhwc, BF16, true) => "conv_direct_nhwc_bf16_f32out",
    }
}

/// The grid: one block per 256 pixels and 8 channels, capped (the kernel strides over more).
fn grid(g: &DirectGeom) -> LaunchConfig {
    let blocks_x = g.pixels.div_ceil(u64::from(THREADS)).clamp(1, MAX_GRID_X) as u32;
    let blocks_y = (g.groups as usize).clamp(1, MAX_GRID_Y) as u32;
    LaunchConfig {
        grid_dim: (blocks_x, blocks_y, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// # Safety
/// As [`forward`]; `y` holds `s.y_len()` elements of f32 (`f32_out`) or `dtype`.
unsafe fn launch(
    ctx: &Context,
    s: &ConvShape,
    dtype: DType,
    (x, w, y): (u64, u64, u64),
    f32_out: bool,
) -> Result<()> {
    let g = geometry(s)?;
    let name = kernel_name(s.format, dtype, f32_out);
    let cfg = grid(&g);
    tracing::debug!(
        kernel = name,
        shape = ?s,
        grid = ?cfg.grid_dim,
        "direct convolution"
    );
    let f = ctx.function(&kernels::CONV_DIRECT, name)?;
    use crate::launch::arg;
    let mut params = [arg(&x), arg(&w), arg(&y), arg(&g)];
    // SAFETY: (const T*, const T*, O*, DirectGeom) is the kernel's signature; DirectGeom is laid
    // out as the kernel's; the caller guarantees the extents.
    unsafe {
        crate::launch::launch_kernel(ctx, &f, cfg, &mut params, "cuLaunchKernel(conv_direct)")
    }
}

/// Runs a direct route (registered in `paths.rs`): the forward only.
///
/// # Safety
/// As [`super::route::run`].
pub(crate) unsafe fn raw_run(c: &PathCall<'_>) -> Result<()> {
    let t = c.target;
    match c.direction {
        // SAFETY: the caller's contract.
        Direction::Forward => unsafe { forward(t.ctx, t.shape, t.dtype, c.fwd()) },
        _ => Err(c.no_direction("the direct kernel")),
    }
}

/// Forward convolution, output in `dtype`.
///
/// # Safety
/// `p` holds device addresses on `ctx`'s device with the shape's extents of `dtype` elements, `y`
/// disjoint from `x` and `w`, all valid until the queued work completes.
#[allow(dead_code)] // called by the convolution dispatcher
pub(crate) unsafe fn forward(ctx: &Context, s: &ConvShape, dtype: DType, p: FwdPtrs) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { launch(ctx, s, dtype, (p.x, p.w, p.y), false) }
}

/// Forward convolution of `dtype` inputs with the output in f32 (not rounded to `dtype`): the
/// reference of the dispatcher's numerical check.
///
/// # Safety
/// As [`forward`]; `y_f32` holds `s.y_len()` f32 elements.
#[allow(dead_code)] // called by the convolution dispatcher
pub(crate) unsafe fn forward_f32_out(
    ctx: &Context,
    s: &ConvShape,
    dtype: DType,
    x: u64,
    w: u64,
    y_f32: u64,
) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { launch(ctx, s, dtype, (x, w, y_f32), true) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::conv as r;
    use TensorFormat::{Nchw, Nhwc};

    #[test]
    fn direct_geom_matches_the_kernel_layout() {
        // kernels/conv_direct.cu: static_assert(sizeof(DirectGeom) == 88).
        assert_eq!(std::mem::size_of::<DirectGeom>(), 88);
        let g = DirectGeom::default();
        let base = &g as *const DirectGeom as usize;
        assert_eq!(&g.c_in as *const u32 as usize - base, 16);
        assert_eq!(&g.sh as *const i32 as usize - base, 48);
        assert_eq!(&g.p as *const u32 as usize - base, 72);
    }

    #[test]
    fn every_kernel_name_is_in_the_compiled_file() {
        if !crate::kernels::nvrtc_present() {
            eprintln!("skipping: NVRTC not found");
            return;
        }
        let image = crate::kernels::compile(&crate::kernels::CONV_DIRECT, "compute_90").unwrap();
        let ptx = String::from_utf8_lossy(image.bytes()).into_owned();
        for format in [Nchw, Nhwc] {
            for dt in DType::ALL {
                for f32_out in [false, true] {
                    let k = kernel_name(format, dt, f32_out);
                    assert!(ptx.contains(&format!(".entry {k}(")), "{k} missing");
                }
            }
        }
    }

    /// `kernels/conv_direct.cu` statement for statement on the CPU (every block, every thread,
    /// every staging round), in f64.
    fn emulate(s: &ConvShape, x: &[f64], w: &[f64]) -> Vec<f64> {
        let g = geometry(s).unwrap();
        let cfg = grid(&g);
        let nhwc = s.format == Nhwc;
        let mut y = vec![f64::NAN; s.y_len().unwrap()];
        let tt_max = THREADS;
        let pixel_blocks = g.pixels.div_ceil(u64::from(THREADS));
        for by in 0..cfg.grid_dim.1 {
            let mut grp = by;
            while grp < g.groups {
                let k0 = grp * KT as u32;
                for bx in 0..cfg.grid_dim.0 {
                    let mut pb = u64::from(bx);
                    while pb < pixel_blocks {
                        // Shared memory of this block, per round.
                        let mut acc = vec![[0.0f64; KT]; THREADS as usize];
                        let mut t0 = 0u32;
                        while t0 < g.k {
                            let mut ws = vec![[0.0f64; KT]; tt_max as usize];
                            for (tid, row) in ws.iter_mut().enumerate() {
                                let t = t0 + tid as u32;
                                for (kk, v) in row.iter_mut().enumerate() {
                                    let k = k0 + kk as u32;
                                    if t < g.k && k < g.c_out {
                                        *v = w[k as usize * g.k as usize + t as usize];
                                    }
                                }
                            }
                            let nt = tt_max.min(g.k - t0);
                            for (tid, a) in acc.iter_mut().enumerate() {
                                let pix = pb * u64::from(THREADS) + tid as u64;
                                let active = pix < g.pixels;
                                let b = if active { pix / u64::from(g.p) } else { 0 };
                                let p = if active {
                                    (pix - b * u64::from(g.p)) as u32
                                } else {
                                    0
                                };
                                let (oy, ox) = (p / g.ow, p % g.ow);
                                let iy0 = oy as i32 * g.sh - g.ph;
                                let ix0 = ox as i32 * g.sw - g.pw;
                                let (mut c, mut r, mut sx);
                                if nhwc {
                                    let rs = t0 / g.c_in;
                                    c = t0 - rs * g.c_in;
                                    r = rs / g.kw;
                                    sx = rs - r * g.kw;
                                } else {
                                    let khkw = g.kh * g.kw;
                                    c = t0 / khkw;
                                    let rs = t0 - c * khkw;
                                    r = rs / g.kw;
                                    sx = rs - r * g.kw;
                                }
                                for wrow in ws.iter().take(nt as usize) {
                                    let iy = iy0 + r as i32 * g.dh;
                                    let ix = ix0 + sx as i32 * g.dw;
                                    let mut xv = 0.0;
                                    if active && (iy as u32) < g.h && (ix as u32) < g.w {
                                        let at = if nhwc {
                                            (iy as u64 * u64::from(g.w) + ix as u64)
                                                * u64::from(g.c_in)
                                                + u64::from(c)
                                        } else {
                                            (u64::from(c) * u64::from(g.h) + iy as u64)
                                                * u64::from(g.w)
                                                + ix as u64
                                        };
                                        xv = x[(b * g.x_img + at) as usize];
                                    }
                                    for kk in 0..KT {
                                        a[kk] += xv * wrow[kk];
                                    }
                                    if nhwc {
                                        c += 1;
                                        if c == g.c_in {
                                            c = 0;
                                            sx += 1;
                                            if sx == g.kw {
                                                sx = 0;
                                                r += 1;
                                            }
                                        }
                                    } else {
                                        sx += 1;
                                        if sx == g.kw {
                                            sx = 0;
                                            r += 1;
                                            if r == g.kh {
                                                r = 0;
                                                c += 1;
                                            }
                                        }
                                    }
                                }
                            }
                            t0 += tt_max;
                        }
                        for (tid, a) in acc.iter().enumerate() {
                            let pix = pb * u64::from(THREADS) + tid as u64;
                            if pix >= g.pixels {
                                continue;
                            }
                            let b = pix / u64::from(g.p);
                            let p = pix - b * u64::from(g.p);
                            for (kk, v) in a.iter().enumerate() {
                                let k = u64::from(k0) + kk as u64;
                                if k < u64::from(g.c_out) {
                                    let at = if nhwc {
                                        (b * u64::from(g.p) + p) * u64::from(g.c_out) + k
                                    } else {
                                        (b * u64::from(g.c_out) + k) * u64::from(g.p) + p
                                    };
                                    y[at as usize] = *v;
                                }
                            }
                        }
                        pb += u64::from(cfg.grid_dim.0);
                    }
                }
                grp += cfg.grid_dim.1;
            }
        }
        y
    }

    use crate::testutil::xorshift_values as values;

    /// The emulated kernel equals the reference on problems that cross every boundary: more
    /// than 256 taps (several staging rounds), more than 256 pixels, channel counts not a
    /// multiple of 8, strides, dilations, asymmetric padding, both formats.
    #[test]
    fn emulated_kernel_equals_the_reference() {
        let mut n = 0;
        for format in [Nchw, Nhwc] {
            for (batch, c_in, h, w, c_out, kh, kw, stride, pad, dilation) in [
                (2, 3, 9, 11, 5, 3, 3, (1, 1), (1, 1), (1, 1)),
                (1, 40, 6, 5, 9, 3, 3, (1, 1), (1, 1), (1, 1)),
                (3, 2, 13, 12, 17, 5, 3, (2, 1), (0, 2), (1, 2)),
                (2, 1, 17, 17, 1, 1, 1, (1, 1), (0, 0), (1, 1)),
                (1, 7, 10, 9, 8, 3, 2, (1, 3), (2, 0), (2, 1)),
                (2, 3, 23, 23, 4, 7, 7, (2, 2), (3, 3), (1, 1)),
            ] {
                let s = ConvShape {
                    n: batch,
                    c_in,
                    h,
                    w,
                    c_out,
                    kh,
                    kw,
                    stride,
                    pad,
                    dilation,
                    format,
                };
                let x = values(n + 1, s.x_len().unwrap());
                let wv = values(n + 2, s.w_len().unwrap());
                let want = r::conv2d(&s, &x, &wv).unwrap();
                let got = emulate(&s, &x, &wv);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!((g - w).abs() <= 1e-12, "{s:?}: y[{i}] = {g}, want {w}");
                }
                n += 1;
            }
        }
    }

    #[test]
    fn grids_and_limits() {
        let s = crate::testutil::square_conv(32, 64, 56, 64, 3, Nhwc);
        let g = geometry(&s).unwrap();
        assert_eq!((g.pixels, g.p, g.k, g.groups), (32 * 3136, 3136, 576, 8));
        assert_eq!(grid(&g).grid_dim, (392, 8, 1));
        let big = ConvShape {
            c_in: 1 << 16,
            h: 1 << 8,
            w: 1 << 8,
            ..s
        };
        assert!(matches!(geometry(&big), Err(Error::NotSupported(_))));
        assert_eq!(
            kernel_name(Nchw, DType::BF16, true),
            "conv_direct_nchw_bf16_f32out"
        );
    }
}

/// GPU tests: the kernel against the f64 reference (both outputs, every data type, poisoned
/// outputs), determinism, and ResNet-50's 3x3 64->64 layer (values, time printed).
#[cfg(test)]
mod gpu_tests {
    use super::*;
    use crate::conv::im2col::gpu_tests::{cases, check, download, poisoned, shapes, upload};
    use crate::dtype::Element;
    use crate::testutil::{gpu, Rng};
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    use half::{bf16, f16};

    fn run<T: Element>(ctx: &Context, rng: &mut Rng) {
        let dt = T::DTYPE;
        for format in [TensorFormat::Nchw, TensorFormat::Nhwc] {
            for c in cases(rng, &shapes(format)) {
                let s = &c.s;
                let x = upload::<T>(ctx, &c.x);
                let w = upload::<T>(ctx, &c.w);
                let mut outs = Vec::new();
                for _ in 0..2 {
                    let mut y = poisoned::<T>(ctx, c.y.len());
                    let p = FwdPtrs {
                        x: x.device_ptr(ctx.stream()).0,
                        w: w.device_ptr(ctx.stream()).0,
                        y: y.device_ptr_mut(ctx.stream()).0,
                    };
                    // SAFETY: buffers of the problem's extents, y disjoint.
                    unsafe { forward(ctx, s, dt, p) }.unwrap();
                    outs.push(download(ctx, &y));
                }
                check(
                    &format!("direct {dt} {s:?}"),
                    &outs[0],
                    &c.y,
                    dt.tolerance(),
                );
                assert!(
                    outs[0]
                        .iter()
                        .zip(&outs[1])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "direct {dt} {s:?}: two runs differ"
                );
                let mut y32 = poisoned::<f32>(ctx, c.y.len());
                let yp = y32.device_ptr_mut(ctx.stream()).0;
                // SAFETY: as above; y32 holds y_len f32.
                unsafe {
                    forward_f32_out(
                        ctx,
                        s,
                        dt,
                        x.device_ptr(ctx.stream()).0,
                        w.device_ptr(ctx.stream()).0,
                        yp,
                    )
                }
                .unwrap();
                // Inputs are exact in every type, products exact in f32: only the f32 sum rounds.
                check(
                    &format!("direct f32-out {dt} {s:?}"),
                    &download(ctx, &y32),
                    &c.y,
                    1e-6,
                );
            }
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn direct_matches_the_reference() {
        let ctx = gpu();
        let mut rng = Rng::fresh("direct_matches_the_reference");
        run::<f32>(&ctx, &mut rng);
        run::<f16>(&ctx, &mut rng);
        run::<bf16>(&ctx, &mut rng);
    }

    /// ResNet-50's 3x3 64->64 layer at 56x56, batch 32, f16: the values of interior outputs, and
    /// the time per call printed (not asserted: tests do not measure speed, and this one also
    /// runs under compute-sanitizer). Expected on an H100: a few ms, tens at worst.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn direct_on_a_resnet_layer() {
        let ctx = gpu();
        for format in [TensorFormat::Nchw, TensorFormat::Nhwc] {
            let s = crate::testutil::square_conv(32, 64, 56, 64, 3, format);
            let x = upload::<f16>(&ctx, &vec![0.5; s.x_len().unwrap()]);
            let w = upload::<f16>(&ctx, &vec![0.25; s.w_len().unwrap()]);
            let mut y = poisoned::<f16>(&ctx, s.y_len().unwrap());
            let p = FwdPtrs {
                x: x.device_ptr(ctx.stream()).0,
                w: w.device_ptr(ctx.stream()).0,
                y: y.device_ptr_mut(ctx.stream()).0,
            };
            // SAFETY: buffers of the problem's extents.
            unsafe { forward(&ctx, &s, DType::F16, p) }.unwrap(); // warm-up, module load
            ctx.synchronize().unwrap();
            let t = std::time::Instant::now();
            for _ in 0..3 {
                // SAFETY: as above.
                unsafe { forward(&ctx, &s, DType::F16, p) }.unwrap();
            }
            ctx.synchronize().unwrap();
            let ms = t.elapsed().as_secs_f64() * 1e3 / 3.0;
            eprintln!("direct 3x3 64->64 56x56 batch 32 f16 {format:?}: {ms:.2} ms");
            // Interior outputs: 576 taps of 0.5 * 0.25 = 72; a corner sees 4 of 9 taps: 32.
            let got = download(&ctx, &y);
            let (interior, corner) = match format {
                TensorFormat::Nchw => (28 * 56 + 28, 0),
                TensorFormat::Nhwc => ((28 * 56 + 28) * 64 + 5, 5),
            };
            assert_eq!(got[interior], 72.0, "{format:?}");
            assert_eq!(got[corner], 32.0, "{format:?}");
            assert!(
                got.iter().all(|v| v.is_finite()),
                "{format:?}: unwritten outputs"
            );
        }
    }
}
