//! GPU tests of the Winograd path: each kernel against the f64 reference's intermediate, the
//! forward and the data gradient against the f64 convolution on a sampled grid of shapes (both
//! tiles, every engine that can run the case, three types), chunking under a tiny workspace cap,
//! prepared filters, and the refusals. The fused engine has its own tests below (the MMA
//! fragment layouts, a grid aimed at its blocking, its refusals). Inputs are fresh random multiples of 1/256 in [-1, 1] (never 0): exact in f32,
//! f16 and bf16, so one f64 reference serves every type and every error is the path's own.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::{bf16, f16};

use super::launch::{self, vec_widths, Stage};
use super::*;
use crate::conv::problem::winograd_dims;
use crate::reference::conv::conv2d;
use crate::reference::winograd as rw;
use crate::testutil::{gpu, gpu_with, rel_l2, Rng};
use crate::{Config, Element};

/// The forward geometry of `s` with `tile`.
fn geo(s: &ConvShape, tile: WinogradTile) -> WinogradGeometry {
    WinogradGeometry::forward(s, tile).unwrap()
}

/// The data-gradient geometry of `s` with `tile`.
fn geo_bwd(s: &ConvShape, tile: WinogradTile) -> WinogradGeometry {
    WinogradGeometry::new(s, Direction::BackwardData, tile)
        .unwrap()
        .unwrap()
}

/// The two batched-multiply engines (chunked through the scratch).
const ENGINES: [WinogradEngine; 2] = [WinogradEngine::TensorCore, WinogradEngine::Direct];

/// The engines that can run `s` (a forward Winograd problem) in `dtype`: both batched-multiply
/// engines, and the fused one where [`super::super::problem::fused_eligible`] allows.
fn engines_for(s: &ConvShape, dtype: DType) -> Vec<WinogradEngine> {
    let mut e = ENGINES.to_vec();
    if super::super::problem::fused_eligible(s, dtype).is_ok() {
        e.push(WinogradEngine::Fused);
    }
    e
}

use crate::testutil::exact_values as exact;

fn up<T: Element>(ctx: &Context, v: &[f64]) -> CudaSlice<T> {
    let h: Vec<T> = v.iter().map(|x| T::from_f64(*x)).collect();
    ctx.stream().clone_htod(&h).unwrap()
}

/// A device buffer of `n` NaNs (an unwritten element shows).
fn poisoned<T: Element>(ctx: &Context, n: usize) -> CudaSlice<T> {
    let mut b = ctx.stream().alloc_zeros::<T>(n.max(1)).unwrap();
    crate::util::fill(ctx, &mut b, T::from_f64(f64::NAN)).unwrap();
    b
}

fn down<T: Element>(ctx: &Context, b: &CudaSlice<T>, n: usize) -> Vec<f64> {
    let h = ctx.stream().clone_dtoh(b).unwrap();
    h[..n].iter().map(|v| v.to_f64()).collect()
}

use crate::testutil::winograd_shape as shape;

/// Relative L2 error of `got` against `want`; panics naming the case and the worst element
/// (described by `at`) when an element is not finite or the error exceeds `tol`.
fn compare(case: &str, got: &[f64], want: &[f64], tol: f64, at: impl Fn(usize) -> String) -> f64 {
    compare_scaled(case, got, want, 0.0, tol, at)
}

/// Outputs with fewer elements than this are bounded against the convolution of |x| and |w|
/// (see [`tiny_scale`]).
const TINY_OUTPUT: usize = 16;

/// The error scale of an output of fewer than [`TINY_OUTPUT`] elements, else 0. Winograd rounds
/// the transformed tile of the input (padding included) and the transformed filter (all nine
/// taps), so its error per output element is a multiple of max|x| · Σ|w over one output
/// channel's taps|, whatever the output itself is. Over many elements the relative L2 error
/// averages that out; an output of one or two elements can be far smaller than its scale (one
/// 3x3 tap of one channel at a 1x1 image: the other eight taps meet padding), so there the
/// error is measured against that scale: √len · max|x| · `tap_sum`.
fn tiny_scale(len: usize, x: &[f64], tap_sum: f64) -> f64 {
    if len >= TINY_OUTPUT {
        return 0.0;
    }
    let max_x = x.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    (len as f64).sqrt() * max_x * tap_sum
}

/// max over output channels k of Σ|w[k][r][s][c]| (KRSC filter, `c_in` input channels).
fn tap_sum_forward(w: &[f64], c_in: usize) -> f64 {
    w.chunks(9 * c_in)
        .map(|k| k.iter().map(|v| v.abs()).sum::<f64>())
        .fold(0.0, f64::max)
}

/// max over input channels c of Σ|w[k][r][s][c]|: the output channels of the data gradient.
fn tap_sum_backward_data(w: &[f64], c_in: usize) -> f64 {
    (0..c_in)
        .map(|c| w.iter().skip(c).step_by(c_in).map(|v| v.abs()).sum::<f64>())
        .fold(0.0, f64::max)
}

/// [`compare`] with the error measured as ‖got − want‖₂ / max(‖want‖₂, `scale`).
fn compare_scaled(
    case: &str,
    got: &[f64],
    want: &[f64],
    scale: f64,
    tol: f64,
    at: impl Fn(usize) -> String,
) -> f64 {
    assert_eq!(got.len(), want.len(), "{case}: length");
    if let Some(e) = got.iter().position(|g| !g.is_finite()) {
        panic!(
            "{case}: element {e} ({}) is {} (want {}): not written or overflowed",
            at(e),
            got[e],
            want[e]
        );
    }
    let norm = want.iter().map(|v| v * v).sum::<f64>().sqrt();
    let err = rel_l2(got, want) * norm / norm.max(scale).max(1e-300);
    if err > tol || err.is_nan() {
        let (worst, _) = got
            .iter()
            .zip(want)
            .map(|(g, w)| (g - w).abs())
            .enumerate()
            .fold((0, -1.0), |a, (i, d)| if d > a.1 { (i, d) } else { a });
        panic!(
            "{case}: relative L2 error {err:.3e} > {tol:.1e}; worst element {worst} ({}): got {} \
             want {}",
            at(worst),
            got[worst],
            want[worst]
        );
    }
    err
}

/// Tolerance of one stage (f32 arithmetic, output rounded once to the type).
fn stage_tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-6,
        DType::F16 => 1e-3,
        DType::BF16 => 8e-3,
    }
}

/// The f64 convolution, images split over threads.
fn conv_ref(p: &ConvShape, x: &[f64], w: &[f64]) -> Vec<f64> {
    let threads = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .min(p.n);
    let per = p.n.div_ceil(threads.max(1));
    let x_img = p.h * p.w * p.c_in;
    let parts: Vec<Vec<f64>> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..p.n)
            .step_by(per)
            .map(|b0| {
                let nb = per.min(p.n - b0);
                let q = ConvShape { n: nb, ..*p };
                let xs = &x[b0 * x_img..(b0 + nb) * x_img];
                sc.spawn(move || conv2d(&q, xs, w).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    parts.concat()
}

/// `(pos, tile, channel)` of element `e` of U or M.
fn ptc(tiles: usize, c: usize) -> impl Fn(usize) -> String {
    move |e| {
        format!(
            "pos {}, tile {}, channel {}",
            e / (tiles * c),
            (e / c) % tiles,
            e % c
        )
    }
}

/// `(image, y, x, channel)` of element `e` of an NHWC tensor.
fn bhwc(h: usize, w: usize, c: usize) -> impl Fn(usize) -> String {
    move |e| {
        format!(
            "image {}, y {}, x {}, channel {}",
            e / (h * w * c),
            (e / (w * c)) % h,
            (e / c) % w,
            e % c
        )
    }
}

fn transforms_on<T: Element>(ctx: &Context, rng: &mut Rng, s: &ConvShape) {
    let dt = T::DTYPE;
    let (oh, ow) = s.out_hw().unwrap();
    let x = exact(rng, s.x_len().unwrap());
    let w = exact(rng, s.w_len().unwrap());
    let dx = up::<T>(ctx, &x);
    let dw = up::<T>(ctx, &w);
    let st = ctx.stream();
    for tile in WinogradTile::ALL {
        let d = winograd_dims(s, tile).unwrap();
        let tiles = s.n * d.tiles_per_image;
        // Input transform, every width the channel count allows.
        let want_u = rw::transform_input(s, tile, &x).unwrap();
        for &v in vec_widths(dt).iter().filter(|&&v| s.c_in % v == 0) {
            let mut du = poisoned::<T>(ctx, want_u.len());
            {
                let (px, _g) = dx.device_ptr(st);
                let (pu, _h) = du.device_ptr_mut(st);
                // SAFETY: x and u hold the whole batch's extents.
                let used = unsafe { input_transform(ctx, &geo(s, tile), dt, px, pu, s.n, Some(v)) };
                assert_eq!(used.unwrap(), v);
            }
            let case = format!("input transform {dt} {} v{v} {s:?}", tile.name());
            let got = down(ctx, &du, want_u.len());
            compare(&case, &got, &want_u, stage_tol(dt), ptc(tiles, s.c_in));
        }
        // Filter transform and its rotated variant.
        for rotated in [false, true] {
            if rotated && winograd_backward_data_eligible(s).is_err() {
                continue;
            }
            let want_v = if rotated {
                rw::transform_filter_rotated(s, tile, &w).unwrap()
            } else {
                rw::transform_filter(s, tile, &w).unwrap()
            };
            let mut dv = poisoned::<T>(ctx, want_v.len());
            {
                let (pw, _g) = dw.device_ptr(st);
                let (pv, _h) = dv.device_ptr_mut(st);
                // SAFETY: w and v hold the filter's and the transformed filter's extents.
                unsafe {
                    if rotated {
                        transform_filter_backward_data(ctx, s, &geo_bwd(s, tile), dt, pw, pv)
                            .unwrap();
                    } else {
                        transform_filter(ctx, &geo(s, tile), dt, pw, pv).unwrap();
                    }
                }
            }
            let case = format!(
                "filter transform{} {dt} {} {s:?}",
                if rotated { " (rotated)" } else { "" },
                tile.name()
            );
            let got = down(ctx, &dv, want_v.len());
            let (rows, cols) = if rotated {
                (s.c_out, s.c_in)
            } else {
                (s.c_in, s.c_out)
            };
            compare(&case, &got, &want_v, stage_tol(dt), move |e| {
                format!(
                    "pos {}, row {}, col {}",
                    e / (rows * cols),
                    (e / cols) % rows,
                    e % cols
                )
            });
        }
        // Output transform from a random product.
        let mprod = exact(rng, s.n * d.m_per_image);
        let dm = up::<T>(ctx, &mprod);
        let want_y = rw::transform_output(s, tile, &mprod).unwrap();
        for &v in vec_widths(dt).iter().filter(|&&v| s.c_out % v == 0) {
            let mut dy = poisoned::<T>(ctx, want_y.len());
            {
                let (pm, _g) = dm.device_ptr(st);
                let (py, _h) = dy.device_ptr_mut(st);
                // SAFETY: m and y hold the whole batch's extents.
                let used =
                    unsafe { output_transform(ctx, &geo(s, tile), dt, pm, py, s.n, Some(v)) };
                assert_eq!(used.unwrap(), v);
            }
            let case = format!("output transform {dt} {} v{v} {s:?}", tile.name());
            let got = down(ctx, &dy, want_y.len());
            compare(&case, &got, &want_y, stage_tol(dt), bhwc(oh, ow, s.c_out));
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn transforms_match_the_reference() {
    let ctx = gpu();
    let mut rng = Rng::fresh("transforms_match_the_reference");
    // Channel counts that take every vector width (1, 2 / 4, 8), filters beyond one 32x32
    // block, images that are not multiples of the tile, paddings 0/1/2 and per-axis.
    let shapes = [
        shape(2, 3, 5, 5, 7, (1, 1)),
        shape(1, 8, 8, 6, 6, (0, 0)),
        shape(3, 16, 33, 7, 5, (2, 1)),
        shape(1, 1, 1, 1, 1, (1, 1)),
        shape(2, 24, 6, 9, 9, (0, 2)),
        shape(1, 6, 40, 4, 4, (1, 1)),
        shape(1, 36, 2, 11, 3, (1, 0)),
    ];
    for s in &shapes {
        transforms_on::<f32>(&ctx, &mut rng, s);
        transforms_on::<f16>(&ctx, &mut rng, s);
        transforms_on::<bf16>(&ctx, &mut rng, s);
    }
}

/// Runs the forward (or, with `prepared`, transform_filter + forward_prepared) and returns y.
fn run_forward<T: Element>(
    ctx: &Context,
    s: &ConvShape,
    tile: WinogradTile,
    engine: WinogradEngine,
    x: &CudaSlice<T>,
    w: &CudaSlice<T>,
    prepared: bool,
) -> Vec<f64> {
    let st = ctx.stream();
    let ylen = s.y_len().unwrap();
    let mut y = poisoned::<T>(ctx, ylen);
    let d = winograd_dims(s, tile).unwrap();
    let mut v = st.alloc_zeros::<T>(d.v).unwrap();
    {
        let (px, _a) = x.device_ptr(st);
        let (pw, _b) = w.device_ptr(st);
        let (py, _c) = y.device_ptr_mut(st);
        let (pv, _d) = v.device_ptr_mut(st);
        // SAFETY: every buffer holds its extent; y is distinct.
        unsafe {
            if prepared {
                transform_filter(ctx, &geo(s, tile), T::DTYPE, pw, pv).unwrap();
                let p = FwdPtrs {
                    x: px,
                    w: pv,
                    y: py,
                };
                forward_prepared(ctx, &geo(s, tile), T::DTYPE, engine, p).unwrap();
            } else {
                let p = FwdPtrs {
                    x: px,
                    w: pw,
                    y: py,
                };
                forward(ctx, &geo(s, tile), T::DTYPE, engine, p).unwrap();
            }
        }
    }
    down(ctx, &y, ylen)
}

/// Errors of one shape for one type: (tile, engine, relative L2 error).
fn forward_case<T: Element>(
    ctx: &Context,
    s: &ConvShape,
    x: &[f64],
    w: &[f64],
    want: &[f64],
    errs: &mut Vec<(DType, WinogradTile, WinogradEngine, f64)>,
) {
    let (dx, dw) = (up::<T>(ctx, x), up::<T>(ctx, w));
    let (oh, ow) = s.out_hw().unwrap();
    let scale = tiny_scale(want.len(), x, tap_sum_forward(w, s.c_in));
    for tile in WinogradTile::ALL {
        for engine in engines_for(s, T::DTYPE) {
            let got = run_forward(ctx, s, tile, engine, &dx, &dw, false);
            let case = format!(
                "forward {} {} {} {s:?}",
                T::DTYPE,
                tile.name(),
                engine.name()
            );
            let bound = rw::error_bound(T::DTYPE, tile);
            let err = compare_scaled(&case, &got, want, scale, bound, bhwc(oh, ow, s.c_out));
            errs.push((T::DTYPE, tile, engine, err));
        }
    }
}

fn print_errors(what: &str, errs: &[(DType, WinogradTile, WinogradEngine, f64)]) {
    eprintln!("{what}: largest relative L2 error against f64 (bound in brackets)");
    for dt in DType::ALL {
        for tile in WinogradTile::ALL {
            for engine in WinogradEngine::ALL {
                let e = errs
                    .iter()
                    .filter(|r| r.0 == dt && r.1 == tile && r.2 == engine)
                    .map(|r| r.3)
                    .fold(0.0f64, f64::max);
                let n = errs
                    .iter()
                    .filter(|r| r.0 == dt && r.1 == tile && r.2 == engine)
                    .count();
                if n == 0 {
                    continue;
                }
                eprintln!(
                    "  {dt:>4} {} {:>11}: {e:.2e} ({:.0e}) over {n} shapes",
                    tile.name(),
                    engine.name(),
                    rw::error_bound(dt, tile)
                );
            }
        }
    }
}

/// A covering sample of the grid: H, W in {1, 5, 7, 14, 31, 56}, C in {1, 3, 8, 30, 64, 129},
/// N in {1, 3, 32}, padding 0/1/2 and different per axis.
fn forward_shapes() -> Vec<ConvShape> {
    vec![
        shape(1, 1, 1, 1, 1, (1, 1)),
        shape(3, 3, 8, 5, 7, (1, 1)),
        shape(1, 8, 3, 7, 5, (0, 0)),
        shape(1, 30, 30, 14, 14, (1, 1)),
        shape(3, 64, 64, 14, 14, (1, 1)),
        shape(1, 129, 8, 7, 7, (2, 2)),
        shape(1, 8, 129, 7, 14, (0, 1)),
        shape(1, 64, 30, 31, 31, (1, 0)),
        shape(1, 3, 64, 56, 56, (1, 1)),
        shape(32, 8, 8, 5, 5, (2, 1)),
        shape(1, 64, 64, 56, 31, (1, 2)),
        shape(3, 1, 129, 31, 7, (2, 0)),
    ]
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn forward_matches_the_f64_convolution() {
    let ctx = gpu();
    let mut rng = Rng::fresh("forward_matches_the_f64_convolution");
    let mut errs = Vec::new();
    // Under the sanitizer: up to the 64-channel 14x14 shape (every kernel variant runs).
    for s in crate::testutil::sanitizer_subset(forward_shapes(), 5) {
        let x = exact(&mut rng, s.x_len().unwrap());
        let w = exact(&mut rng, s.w_len().unwrap());
        let want = conv_ref(&s, &x, &w);
        forward_case::<f32>(&ctx, &s, &x, &w, &want, &mut errs);
        forward_case::<f16>(&ctx, &s, &x, &w, &want, &mut errs);
        forward_case::<bf16>(&ctx, &s, &x, &w, &want, &mut errs);
    }
    print_errors("forward", &errs);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn forward_chunks_under_a_tiny_workspace_cap() {
    let ctx = gpu_with(Config::default().with_conv_workspace_mb(1));
    let mut rng = Rng::fresh("forward_chunks_under_a_tiny_workspace_cap");
    let s = shape(32, 30, 30, 14, 14, (1, 1));
    let x = exact(&mut rng, s.x_len().unwrap());
    let w = exact(&mut rng, s.w_len().unwrap());
    let want = conv_ref(&s, &x, &w);
    for dt in DType::ALL {
        for tile in WinogradTile::ALL {
            let plan = launch::chunk_plan(
                &geo(&s, tile),
                dt.size(),
                ctx.config().conv_workspace_bytes(),
                true,
                default_chunking(&ctx),
            )
            .unwrap();
            assert!(plan.chunks.len() > 2, "{dt} {tile:?}: {:?}", plan.chunks);
            assert!(plan.layout.bytes <= (1 << 20) + 2 * launch::REGION_ALIGN);
            eprintln!("{dt} {}: chunks {:?}", tile.name(), plan.chunks);
        }
    }
    let mut errs = Vec::new();
    forward_case::<f32>(&ctx, &s, &x, &w, &want, &mut errs);
    forward_case::<f16>(&ctx, &s, &x, &w, &want, &mut errs);
    forward_case::<bf16>(&ctx, &s, &x, &w, &want, &mut errs);
    print_errors("forward, 1 MiB workspace cap", &errs);
    // One image larger than the cap: refused, nothing written.
    let big = shape(1, 256, 256, 56, 56, (1, 1));
    let (bx, bw) = (
        up::<f16>(&ctx, &vec![1.0; big.x_len().unwrap()]),
        up::<f16>(&ctx, &vec![1.0; big.w_len().unwrap()]),
    );
    let mut by = poisoned::<f16>(&ctx, big.y_len().unwrap());
    let st = ctx.stream();
    let (px, _a) = bx.device_ptr(st);
    let (pw, _b) = bw.device_ptr(st);
    let (py, _c) = by.device_ptr_mut(st);
    let p = FwdPtrs {
        x: px,
        w: pw,
        y: py,
    };
    // SAFETY: valid buffers; the call is refused before any launch.
    let e = unsafe {
        forward(
            &ctx,
            &geo(&big, WinogradTile::F4x3),
            DType::F16,
            WinogradEngine::TensorCore,
            p,
        )
    }
    .unwrap_err();
    assert!(e.to_string().contains("workspace cap"), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn prepared_filter_gives_the_same_result() {
    let ctx = gpu();
    let mut rng = Rng::fresh("prepared_filter_gives_the_same_result");
    for s in [
        shape(2, 64, 32, 14, 14, (1, 1)),
        shape(1, 30, 3, 9, 7, (0, 2)),
    ] {
        let x = up::<f16>(&ctx, &exact(&mut rng, s.x_len().unwrap()));
        let w = up::<f16>(&ctx, &exact(&mut rng, s.w_len().unwrap()));
        for tile in WinogradTile::ALL {
            for engine in engines_for(&s, DType::F16) {
                let a = run_forward(&ctx, &s, tile, engine, &x, &w, false);
                let b = run_forward(&ctx, &s, tile, engine, &x, &w, true);
                // Same kernels and the same GEMM key: the same bits with Direct; cuBLAS is
                // deterministic for one algorithm too, but allow its rounding if it is not.
                let same = a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits());
                let diff = rel_l2(&b, &a);
                eprintln!(
                    "{} {} {s:?}: prepared vs unprepared: bitwise {same}, relative {diff:.1e}",
                    tile.name(),
                    engine.name()
                );
                match engine {
                    // The same kernels on the same V, no atomics: the same bits.
                    WinogradEngine::Direct | WinogradEngine::Fused => {
                        assert!(same, "{tile:?} {engine:?}: prepared differs ({diff})")
                    }
                    WinogradEngine::TensorCore => assert!(diff < 1e-3, "{tile:?}: {diff}"),
                }
            }
        }
    }
}

fn backward_case<T: Element>(
    ctx: &Context,
    s: &ConvShape,
    dy: &[f64],
    w: &[f64],
    want: &[f64],
    errs: &mut Vec<(DType, WinogradTile, WinogradEngine, f64)>,
) {
    let st = ctx.stream();
    let (ddy, dw) = (up::<T>(ctx, dy), up::<T>(ctx, w));
    let eq = crate::reference::winograd::backward_data_problem(s).unwrap();
    let scale = tiny_scale(want.len(), dy, tap_sum_backward_data(w, s.c_in));
    for tile in WinogradTile::ALL {
        for engine in engines_for(&eq, T::DTYPE) {
            for prepared in [false, true] {
                let mut dx = poisoned::<T>(ctx, s.x_len().unwrap());
                let mut v = st
                    .alloc_zeros::<T>(winograd_dims(s, tile).unwrap().v)
                    .unwrap();
                {
                    let (pg, _a) = ddy.device_ptr(st);
                    let (pw, _b) = dw.device_ptr(st);
                    let (px, _c) = dx.device_ptr_mut(st);
                    let (pv, _d) = v.device_ptr_mut(st);
                    // SAFETY: every buffer holds its extent; dx is distinct.
                    unsafe {
                        if prepared {
                            transform_filter_backward_data(
                                ctx,
                                s,
                                &geo_bwd(s, tile),
                                T::DTYPE,
                                pw,
                                pv,
                            )
                            .unwrap();
                            let p = BwdDataPtrs {
                                dy: pg,
                                w: pv,
                                dx: px,
                            };
                            backward_data_prepared(ctx, s, &geo_bwd(s, tile), T::DTYPE, engine, p)
                                .unwrap();
                        } else {
                            let p = BwdDataPtrs {
                                dy: pg,
                                w: pw,
                                dx: px,
                            };
                            backward_data(ctx, s, &geo_bwd(s, tile), T::DTYPE, engine, p).unwrap();
                        }
                    }
                }
                let got = down(ctx, &dx, s.x_len().unwrap());
                let case = format!(
                    "backward data{} {} {} {} {s:?}",
                    if prepared { " (prepared)" } else { "" },
                    T::DTYPE,
                    tile.name(),
                    engine.name()
                );
                let bound = rw::error_bound(T::DTYPE, tile);
                let err = compare_scaled(&case, &got, want, scale, bound, bhwc(s.h, s.w, s.c_in));
                if !prepared {
                    errs.push((T::DTYPE, tile, engine, err));
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn backward_data_matches_the_adjoint() {
    let ctx = gpu();
    let mut rng = Rng::fresh("backward_data_matches_the_adjoint");
    let mut errs = Vec::new();
    for s in [
        shape(2, 3, 8, 5, 7, (1, 1)),
        shape(1, 30, 30, 14, 14, (0, 0)),
        shape(1, 64, 129, 7, 7, (2, 2)),
        shape(3, 8, 3, 31, 5, (2, 0)),
        shape(1, 129, 64, 14, 14, (1, 2)),
        shape(1, 1, 1, 1, 1, (1, 1)),
        // Channel counts the fused engine takes (multiples of 8), both ways round.
        shape(2, 16, 24, 9, 11, (1, 1)),
        shape(1, 40, 8, 14, 13, (2, 0)),
    ] {
        let (oh, ow) = s.out_hw().unwrap();
        let dy = exact(&mut rng, s.n * oh * ow * s.c_out);
        let w = exact(&mut rng, s.w_len().unwrap());
        // The adjoint written from the definition (independent of the rotation trick).
        let want = rw::conv2d_backward_data_adjoint(&s, &dy, &w).unwrap();
        backward_case::<f32>(&ctx, &s, &dy, &w, &want, &mut errs);
        backward_case::<f16>(&ctx, &s, &dy, &w, &want, &mut errs);
        backward_case::<bf16>(&ctx, &s, &dy, &w, &want, &mut errs);
    }
    print_errors("backward data", &errs);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn refuses_what_winograd_cannot_run() {
    let ctx = gpu();
    let st = ctx.stream();
    let buf = st.alloc_zeros::<f32>(1 << 16).unwrap();
    let (p0, _g) = buf.device_ptr(st);
    let p = FwdPtrs {
        x: p0,
        w: p0 + 4 * 8192,
        y: p0 + 4 * 16384,
    };
    let mut s = shape(1, 4, 8, 8, 4, (1, 1));
    s.stride = (2, 2);
    // SAFETY: refused before any launch.
    let e = unsafe {
        forward(
            &ctx,
            &geo(&s, WinogradTile::F2x3),
            DType::F32,
            WinogradEngine::Direct,
            p,
        )
    }
    .unwrap_err();
    assert_eq!(e.argument(), Some("shape"), "{e}");
    assert!(e.to_string().contains("stride"), "{e}");
    let s = shape(1, 4, 8, 8, 4, (3, 1));
    let q = BwdDataPtrs {
        dy: p0,
        w: p0 + 4 * 8192,
        dx: p0 + 4 * 16384,
    };
    // SAFETY: refused before any launch.
    let e = unsafe {
        // Padding over 2 has no data-gradient geometry: the forward one stands in, and the
        // shape's own check refuses first.
        backward_data(
            &ctx,
            &s,
            &geo(&s, WinogradTile::F2x3),
            DType::F32,
            WinogradEngine::Direct,
            q,
        )
    }
    .unwrap_err();
    assert!(e.to_string().contains("padding"), "{e}");
    // A forced width the channels do not allow.
    let s = shape(1, 6, 4, 8, 8, (1, 1));
    // SAFETY: refused before any launch.
    let e = unsafe {
        input_transform(
            &ctx,
            &geo(&s, WinogradTile::F4x3),
            DType::F16,
            p0,
            p0 + 8192,
            1,
            Some(8),
        )
    }
    .unwrap_err();
    assert_eq!(e.argument(), Some("vec"));
    // A misaligned pointer for 16-byte accesses.
    let s = shape(1, 8, 4, 8, 8, (1, 1));
    // SAFETY: refused before any launch.
    let e = unsafe {
        input_transform(
            &ctx,
            &geo(&s, WinogradTile::F4x3),
            DType::F16,
            p0 + 2,
            p0 + 8192,
            1,
            Some(8),
        )
    }
    .unwrap_err();
    assert_eq!(e.argument(), Some("vec"));
    // The widest width is chosen from the channels and the alignment.
    assert_eq!(
        launch::choose_vec(
            Stage::Input,
            WinogradTile::F2x3,
            DType::F16,
            8,
            &[p0 + 2, p0]
        ),
        1
    );
    assert_eq!(
        launch::transform_kernel(Stage::Input, DType::F16, WinogradTile::F4x3, 8),
        Some("winograd_input_f4x3_f16_v8")
    );
}

/// L2-resident chunks against one chunk as large as the cap allows (the default), on a layer
/// the L2 rule splits: the Direct multiply computes each element the same way whatever the
/// chunk, so the results are bitwise equal; the tensor-core GEMM may pick another kernel for
/// another chunk width, so it is compared within the type's rounding.
#[test]
#[ignore = "needs a CUDA GPU"]
fn l2_resident_chunks_equal_one_chunk() {
    let ctx = gpu();
    let mut rng = Rng::fresh("l2_resident_chunks_equal_one_chunk");
    let s = shape(32, 64, 64, 56, 56, (1, 1));
    let x = up::<f16>(&ctx, &exact(&mut rng, s.x_len().unwrap()));
    let w = up::<f16>(&ctx, &exact(&mut rng, s.w_len().unwrap()));
    let st = ctx.stream();
    let l2 = Chunking::L2Resident {
        l2_bytes: ctx.info().l2_bytes.max(0) as usize,
    };
    assert_eq!(default_chunking(&ctx), Chunking::WorkspaceCap);
    for tile in WinogradTile::ALL {
        let plan = launch::chunk_plan(
            &geo(&s, tile),
            2,
            ctx.config().conv_workspace_bytes(),
            true,
            l2,
        )
        .unwrap();
        assert!(
            plan.l2_limited && plan.chunks.len() > 1,
            "{:?}",
            plan.chunks
        );
        for engine in ENGINES {
            let mut out = Vec::new();
            for chunking in [l2, Chunking::WorkspaceCap] {
                let mut y = poisoned::<f16>(&ctx, s.y_len().unwrap());
                {
                    let (px, _a) = x.device_ptr(st);
                    let (pw, _b) = w.device_ptr(st);
                    let (py, _c) = y.device_ptr_mut(st);
                    let p = FwdPtrs {
                        x: px,
                        w: pw,
                        y: py,
                    };
                    // SAFETY: every buffer holds its extent; y is distinct.
                    unsafe {
                        forward_chunked(&ctx, &geo(&s, tile), DType::F16, engine, p, chunking)
                    }
                    .unwrap();
                }
                out.push(down(&ctx, &y, s.y_len().unwrap()));
            }
            assert!(out[0].iter().all(|v| v.is_finite()), "{tile:?} {engine:?}");
            let diff = rel_l2(&out[0], &out[1]);
            eprintln!(
                "{} {}: chunks {:?}, L2-resident vs one chunk: relative difference {diff:.2e}",
                tile.name(),
                engine.name(),
                plan.chunks
            );
            match engine {
                WinogradEngine::Direct => assert_eq!(diff, 0.0, "{tile:?}: Direct differs"),
                WinogradEngine::TensorCore => assert!(diff < 2e-3, "{tile:?}: {diff}"),
                WinogradEngine::Fused => unreachable!("not a chunked engine"),
            }
        }
    }
}

// ---- the fused engine -----------------------------------------------------------------------

/// Runs the fused kernel's fragment-layout probe on A (16 x 16) and B (16 x 8), both row-major,
/// and returns D = A · B (16 x 8, row-major) as the GPU computed it.
fn probe<T: Element>(ctx: &Context, a: &[f64], b: &[f64]) -> Vec<f64> {
    let st = ctx.stream();
    let (da, db) = (up::<T>(ctx, a), up::<T>(ctx, b));
    let mut dd = st.alloc_zeros::<f32>(16 * 8).unwrap();
    crate::util::fill(ctx, &mut dd, f32::NAN).unwrap();
    let name = fused::probe_kernel(T::DTYPE).unwrap();
    let f = ctx
        .function(fused::unit(T::DTYPE, None).unwrap(), name)
        .unwrap();
    {
        let (pa, _a) = da.device_ptr(st);
        let (pb, _b) = db.device_ptr(st);
        let (pd, _d) = dd.device_ptr_mut(st);
        let mut l = st.launch_builder(&f);
        l.arg(&pa).arg(&pb).arg(&pd);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: a holds 256, b 128 and d 128 elements, as the probe reads and writes.
        unsafe { l.launch(cfg) }.unwrap();
    }
    st.clone_dtoh(&dd)
        .unwrap()
        .iter()
        .map(|&v| v as f64)
        .collect()
}

fn matrix(m: &[f64], cols: usize) -> String {
    m.chunks(cols)
        .map(|r| {
            r.iter()
                .map(|v| format!("{v:7.3}"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The fused kernel's fragment helpers (the same functions, the same shared layouts) on one
/// `mma.sync.m16n8k16`, for both 16-bit types, against the exact product. Three inputs make a
/// wrong layout readable from the output: A = I (then D must equal B), B = the first and the
/// last eight rows of I (then D shows A's columns 0-7 and 8-15), and random values (exact in
/// f32: multiples of 1/256, sums of 16 products).
#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_mma_fragments_match_the_ptx_layouts() {
    let ctx = gpu();
    let mut rng = Rng::fresh("fused_mma_fragments_match_the_ptx_layouts");
    let eye_a: Vec<f64> = (0..256)
        .map(|e| if e / 16 == e % 16 { 1.0 } else { 0.0 })
        .collect();
    let numbered_a: Vec<f64> = (0..256).map(|e| (e as f64 + 1.0) / 256.0).collect();
    let numbered_b: Vec<f64> = (0..128).map(|e| (e as f64 + 1.0) / 128.0).collect();
    let eye_b = |off: usize| -> Vec<f64> {
        (0..128)
            .map(|e| if e / 8 == e % 8 + off { 1.0 } else { 0.0 })
            .collect()
    };
    let cases: Vec<(&str, Vec<f64>, Vec<f64>)> = vec![
        ("A = I, B numbered: D must equal B", eye_a, numbered_b),
        (
            "A numbered, B = rows 0-7 of I: D must equal A's columns 0-7",
            numbered_a.clone(),
            eye_b(0),
        ),
        (
            "A numbered, B = rows 8-15 of I: D must equal A's columns 8-15",
            numbered_a,
            eye_b(8),
        ),
        ("random", exact(&mut rng, 256), exact(&mut rng, 128)),
    ];
    for dt in [DType::F16, DType::BF16] {
        for (what, a, b) in &cases {
            let got = match dt {
                DType::F16 => probe::<f16>(&ctx, a, b),
                _ => probe::<bf16>(&ctx, a, b),
            };
            let mut want = vec![0.0; 128];
            for r in 0..16 {
                for n in 0..8 {
                    want[r * 8 + n] = (0..16).map(|k| a[r * 16 + k] * b[k * 8 + n]).sum();
                }
            }
            let bad: Vec<String> = (0..128)
                .filter(|&e| got[e] != want[e])
                .take(8)
                .map(|e| format!("D[{}][{}] = {} want {}", e / 8, e % 8, got[e], want[e]))
                .collect();
            assert!(
                bad.is_empty(),
                "{dt} {what}: {}\ngot D:\n{}\nwant D:\n{}",
                bad.join("; "),
                matrix(&got, 8),
                matrix(&want, 8)
            );
        }
    }
}

/// Where element `e` of a fused forward's y (NHWC) comes from: tile, block, warp, lane,
/// fragment and accumulator, so a failure points at the kernel's index arithmetic.
fn fused_at(s: &ConvShape, tile: WinogradTile) -> impl Fn(usize) -> String {
    let (oh, ow) = s.out_hw().unwrap();
    let d = winograd_dims(s, tile).unwrap();
    let c = fused::cfg(tile);
    let (m, k) = (tile.m(), s.c_out);
    move |e| {
        let kk = e % k;
        let ox = (e / k) % ow;
        let oy = (e / (k * ow)) % oh;
        let b = e / (k * ow * oh);
        let (th, tw) = (oy / m, ox / m);
        let t = (b * d.tiles_h + th) * d.tiles_w + tw;
        let tl = t % fused::TILES_PER_BLOCK;
        let kin = kk % c.tk;
        let lane = (tl % 8) * 4 + (kin % 8) / 2;
        format!(
            "image {b}, y {oy}, x {ox}, channel {kk} = tile {t} (row {th}, col {tw}) output \
             ({}, {}); block ({}, {}), warp (tiles {}, channels {}), lane {lane}, fragment {}, \
             accumulator {}",
            oy % m,
            ox % m,
            t / fused::TILES_PER_BLOCK,
            kk / c.tk,
            tl / 16,
            kin / (8 * c.nf),
            (kin % (8 * c.nf)) / 8,
            2 * ((tl % 16) / 8) + kin % 2
        )
    }
}

/// The fused forward against the f64 convolution (and next to the tensor-core engine) on shapes
/// aimed at its blocking: channel counts not multiples of 16 (a half-empty last chunk), output
/// channels not multiples of a block's 32 (F(4x4)) or 64 (F(2x2)), tile counts not multiples of
/// 32, images smaller than a tile, paddings 0/1/2 and per-axis, N in {1, 3, 32}; f16 and bf16,
/// both tiles, unprepared and prepared.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_forward_matches_the_f64_convolution() {
    let ctx = gpu();
    let mut rng = Rng::fresh("fused_forward_matches_the_f64_convolution");
    let shapes = [
        shape(1, 8, 8, 1, 1, (1, 1)),
        shape(3, 8, 24, 5, 7, (1, 1)),
        shape(1, 24, 40, 7, 5, (0, 0)),
        shape(2, 64, 64, 14, 14, (1, 1)),
        shape(1, 136, 72, 9, 9, (2, 2)),
        shape(1, 16, 8, 31, 31, (1, 0)),
        shape(32, 16, 16, 7, 7, (1, 1)),
        shape(1, 64, 64, 56, 56, (1, 1)),
        shape(3, 32, 48, 14, 31, (2, 1)),
        shape(2, 8, 128, 6, 10, (0, 2)),
    ];
    let mut errs = Vec::new();
    // Under the sanitizer: up to the 64-channel 14x14 shape.
    for s in &crate::testutil::sanitizer_subset(shapes.to_vec(), 4) {
        let x = exact(&mut rng, s.x_len().unwrap());
        let w = exact(&mut rng, s.w_len().unwrap());
        let want = conv_ref(s, &x, &w);
        fused_case::<f16>(&ctx, s, &x, &w, &want, &mut errs);
        fused_case::<bf16>(&ctx, s, &x, &w, &want, &mut errs);
    }
    print_errors("fused forward", &errs);
}

fn fused_case<T: Element>(
    ctx: &Context,
    s: &ConvShape,
    x: &[f64],
    w: &[f64],
    want: &[f64],
    errs: &mut Vec<(DType, WinogradTile, WinogradEngine, f64)>,
) {
    let (dx, dw) = (up::<T>(ctx, x), up::<T>(ctx, w));
    for tile in WinogradTile::ALL {
        let bound = rw::error_bound(T::DTYPE, tile);
        let fused = run_forward(ctx, s, tile, WinogradEngine::Fused, &dx, &dw, false);
        let case = format!("fused forward {} {} {s:?}", T::DTYPE, tile.name());
        let err = compare(&case, &fused, want, bound, fused_at(s, tile));
        errs.push((T::DTYPE, tile, WinogradEngine::Fused, err));
        let prepared = run_forward(ctx, s, tile, WinogradEngine::Fused, &dx, &dw, true);
        assert!(
            prepared
                .iter()
                .zip(&fused)
                .all(|(p, q)| p.to_bits() == q.to_bits()),
            "{case}: prepared differs from unprepared"
        );
        let tc = run_forward(ctx, s, tile, WinogradEngine::TensorCore, &dx, &dw, false);
        let tc_err = rel_l2(&tc, want);
        eprintln!(
            "{case}: fused {err:.2e}, tensor_core {tc_err:.2e}, fused vs tensor_core {:.2e}",
            rel_l2(&fused, &tc)
        );
    }
}

/// What the fused engine cannot run is refused before any launch, naming the argument, and y
/// stays as it was.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_refuses_what_it_cannot_run() {
    let ctx = gpu();
    let st = ctx.stream();
    let run = |s: &ConvShape, dtype: DType, off: (u64, u64)| -> Error {
        let n = (s.x_len().unwrap() + s.w_len().unwrap() + s.y_len().unwrap()) * 4 + 1024;
        let buf = st.alloc_zeros::<u8>(n).unwrap();
        let mut y = poisoned::<f32>(&ctx, s.y_len().unwrap());
        let e = {
            let (p0, _g) = buf.device_ptr(st);
            let (py, _h) = y.device_ptr_mut(st);
            let p = FwdPtrs {
                x: p0 + off.0,
                w: p0 + 512 + (s.x_len().unwrap() * 4) as u64,
                y: py + off.1,
            };
            // SAFETY: the buffers hold the extents; every call here is refused before a launch.
            unsafe {
                forward(
                    &ctx,
                    &geo(s, WinogradTile::F4x3),
                    dtype,
                    WinogradEngine::Fused,
                    p,
                )
            }
            .unwrap_err()
        };
        let after = st.clone_dtoh(&y).unwrap();
        assert!(after.iter().all(|v| v.is_nan()), "{e}: y was written");
        e
    };
    let ok = shape(1, 16, 16, 8, 8, (1, 1));
    let e = run(&ok, DType::F32, (0, 0));
    assert_eq!(e.argument(), Some("shape"), "{e}");
    assert!(e.to_string().contains("f16 and bf16"), "{e}");
    let e = run(&shape(1, 12, 16, 8, 8, (1, 1)), DType::F16, (0, 0));
    assert!(e.to_string().contains("c_in = 12"), "{e}");
    let e = run(&ok, DType::F16, (8, 0));
    assert_eq!(e.argument(), Some("x"), "{e}");
    let e = run(&ok, DType::BF16, (0, 2));
    assert_eq!(e.argument(), Some("y"), "{e}");
    // No separate multiply.
    let e = {
        let buf = st.alloc_zeros::<f16>(1 << 16).unwrap();
        let (p0, _g) = buf.device_ptr(st);
        // SAFETY: refused before any launch.
        unsafe {
            multiply(
                &ctx,
                &geo(&ok, WinogradTile::F4x3),
                DType::F16,
                WinogradEngine::Fused,
                p0,
                p0 + 4096,
                p0 + 8192,
                4,
            )
        }
        .unwrap_err()
    };
    assert_eq!(e.argument(), Some("engine"), "{e}");
}
