//! GPU unit tests of the im2col kernels and the im2col + GEMM path (`#[ignore]`d: they need a
//! CUDA GPU), and the helpers the direct kernel's tests share: problems with their f64
//! references, device buffers, comparisons that say which case and which element failed.
//!
//! Inputs are fresh random multiples of 1/128 in [-1, 1] (never 0): exact in f32, f16 and bf16,
//! so one f64 reference serves every data type.

use std::collections::HashMap;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::launch::{self, ColLayout};
use super::{backward_data, backward_filter, forward, launch_cols};
use crate::conv::{BwdDataPtrs, BwdFilterPtrs, ConvShape, FwdPtrs};
use crate::dtype::{DType, Element};
use crate::layout::TensorFormat::{self, Nchw, Nhwc};
use crate::reference::conv as r;
use crate::testutil::{f64s, gpu_with, rel_l2, Rng};
use crate::{Config, Context};
use half::{bf16, f16};

/// Random nonzero multiples of 1/128 in [-1, 1].
pub(crate) fn quantized(rng: &mut Rng, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| {
            let k = rng.uniform(-128.0, 128.0).round();
            if k == 0.0 {
                1.0 / 128.0
            } else {
                k / 128.0
            }
        })
        .collect()
}

/// One problem, its inputs and its f64 results.
pub(crate) struct Case {
    pub s: ConvShape,
    pub x: Vec<f64>,
    pub w: Vec<f64>,
    pub dy: Vec<f64>,
    /// The filter gradient's previous value (for `accumulate`).
    pub old_dw: Vec<f64>,
    pub y: Vec<f64>,
    pub dx: Vec<f64>,
    pub dw: Vec<f64>,
}

/// The cases for `shapes`, references computed on several threads.
pub(crate) fn cases(rng: &mut Rng, shapes: &[ConvShape]) -> Vec<Case> {
    let inputs: Vec<_> = shapes
        .iter()
        .map(|s| {
            // ok: test fixtures; the shapes are the tests' own valid ones.
            let y_len = s.y_len().unwrap();
            (
                *s,
                quantized(rng, s.x_len().unwrap()),
                quantized(rng, s.w_len().unwrap()),
                quantized(rng, y_len),
                quantized(rng, s.w_len().unwrap()),
            )
        })
        .collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = inputs
            .into_iter()
            .map(|(s, x, w, dy, old_dw)| {
                scope.spawn(move || {
                    // ok: the f64 references of the tests' valid shapes cannot fail.
                    let y = r::conv2d(&s, &x, &w).unwrap();
                    let dx = r::conv2d_backward_data(&s, &dy, &w).unwrap();
                    let dw = r::conv2d_backward_filter(&s, &x, &dy).unwrap();
                    Case {
                        s,
                        x,
                        w,
                        dy,
                        old_dw,
                        y,
                        dx,
                        dw,
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `values` rounded to `T` on the device.
pub(crate) fn upload<T: Element>(ctx: &Context, values: &[f64]) -> CudaSlice<T> {
    let host: Vec<T> = values.iter().map(|&v| T::from_f64(v)).collect();
    ctx.stream().clone_htod(&host).unwrap()
}

/// `n` elements of NaN.
pub(crate) fn poisoned<T: Element>(ctx: &Context, n: usize) -> CudaSlice<T> {
    let mut b = ctx.stream().alloc_zeros::<T>(n.max(1)).unwrap();
    crate::util::fill(ctx, &mut b, T::from_f64(f64::NAN)).unwrap();
    b
}

/// The buffer widened to f64 (synchronises).
pub(crate) fn download<T: Element>(ctx: &Context, b: &CudaSlice<T>) -> Vec<f64> {
    f64s(&ctx.stream().clone_dtoh(b).unwrap())
}

/// Panics with the case, the first non-finite element or the worst one, when `got` is not
/// within `tol` (relative L2) of `want`.
pub(crate) fn check(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!(
            "{what}: element {i} of {} is {} (unwritten: still the NaN poison?), want {}",
            got.len(),
            got[i],
            want[i]
        );
    }
    let e = rel_l2(got, want);
    if e > tol {
        let (i, d) = got
            .iter()
            .zip(want)
            .map(|(g, w)| (g - w).abs())
            .enumerate()
            .fold((0, 0.0), |m, (i, d)| if d > m.1 { (i, d) } else { m });
        panic!(
            "{what}: relative L2 error {e:.3e} > {tol:.0e}; worst element {i} of {}: got {} want {} \
             (|diff| {d:.3e})",
            got.len(),
            got[i],
            want[i]
        );
    }
}

fn ptr<T: Element>(ctx: &Context, b: &CudaSlice<T>) -> u64 {
    b.device_ptr(ctx.stream()).0
}

fn ptr_mut<T: Element>(ctx: &Context, b: &mut CudaSlice<T>) -> u64 {
    b.device_ptr_mut(ctx.stream()).0
}

#[allow(clippy::too_many_arguments)]
fn shape(
    n: usize,
    c_in: usize,
    (h, w): (usize, usize),
    c_out: usize,
    (kh, kw): (usize, usize),
    stride: (usize, usize),
    pad: (usize, usize),
    dilation: (usize, usize),
    format: TensorFormat,
) -> ConvShape {
    ConvShape {
        n,
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
    }
}

/// A covering set of problems: channel counts that fill 16-byte units and that do not (1, 3,
/// 5, 12, 30, 129), odd sizes, stride 2, dilation 2 (also both at once: col2im's tap stepping),
/// asymmetric padding, 7x7/2, pointwise (also over enough pixels that NCHW f32's filter gradient
/// cuts each image into pieces), and a stem wide enough that the NHWC rows kernel splits its
/// output rows into two blocks.
pub(crate) fn shapes(format: TensorFormat) -> Vec<ConvShape> {
    vec![
        shape(5, 32, (20, 20), 24, (3, 3), (1, 1), (1, 1), (1, 1), format),
        shape(3, 3, (31, 29), 8, (7, 7), (2, 2), (3, 3), (1, 1), format),
        shape(4, 64, (14, 14), 16, (1, 1), (1, 1), (0, 0), (1, 1), format),
        shape(3, 30, (15, 15), 7, (1, 1), (2, 2), (0, 0), (1, 1), format),
        shape(2, 8, (13, 11), 5, (3, 3), (1, 1), (2, 2), (2, 2), format),
        shape(3, 129, (7, 7), 3, (3, 3), (1, 1), (1, 0), (1, 1), format),
        shape(1, 1, (5, 1), 1, (3, 1), (1, 1), (1, 0), (1, 1), format),
        shape(2, 12, (9, 10), 5, (3, 2), (2, 1), (0, 2), (1, 2), format),
        shape(2, 5, (11, 12), 3, (3, 3), (2, 2), (1, 2), (2, 2), format),
        // Pointwise over 3136 pixels: NCHW f32's filter gradient in 4 pieces per image.
        shape(2, 24, (56, 56), 20, (1, 1), (1, 1), (0, 0), (1, 1), format),
        // Last: path_with_the_gemm_search takes the first shape for its chunked problem.
        shape(2, 3, (9, 250), 4, (7, 7), (2, 2), (3, 3), (1, 1), format),
    ]
}

/// im2col of the whole batch (public entry) and of a chunk at an image offset (the internal
/// launch the path uses, including the filter gradient's `[K][chunk][P]` NCHW layout), against
/// the reference bit for bit, for every data type, with x and the columns both aligned and
/// either one element off (which forces narrower units, and the rows kernel's unaligned head
/// and tail).
fn im2col_bitwise<T: Element>(ctx: &Context, rng: &mut Rng) {
    let dt = T::DTYPE;
    for format in [Nchw, Nhwc] {
        for s in shapes(format) {
            let (oh, ow) = s.out_hw().unwrap();
            let (p, k) = (oh * ow, s.c_in * s.kh * s.kw);
            let xv = quantized(rng, s.x_len().unwrap() + 1);
            for (skew, cskew) in [(0usize, 0usize), (1, 0), (0, 1)] {
                let x = upload::<T>(ctx, &xv);
                let x_view = x.slice(skew..skew + s.x_len().unwrap());
                let want = r::im2col(&s, &xv[skew..skew + s.x_len().unwrap()]).unwrap();
                let mut cols = poisoned::<T>(ctx, want.len() + 1);
                let es = dt.size() as u64;
                let (xa, ca) = (
                    ptr(ctx, &x) + skew as u64 * es,
                    ptr_mut(ctx, &mut cols) + cskew as u64 * es,
                );
                let kernel =
                    launch::im2col(&s, ColLayout::standard(p, k), es as usize, s.n, xa, ca)
                        .unwrap()
                        .kernel;
                let mut c_view = cols.slice_mut(cskew..cskew + want.len());
                super::im2col(ctx, &s, &x_view, &mut c_view).unwrap();
                let got = download(ctx, &cols);
                for (i, (g, w)) in got[cskew..].iter().zip(&want).enumerate() {
                    assert!(
                        g.to_bits() == w.to_bits(),
                        "im2col {dt} {s:?} x skew {skew} cols skew {cskew} ({kernel}): column \
                         element {i}: got {g} want {w}"
                    );
                }
                // The element outside the view is untouched.
                let outside = if cskew == 0 { got[want.len()] } else { got[0] };
                assert!(outside.is_nan(), "im2col {dt} {s:?}: wrote outside cols");
            }
            // Images 1.. of the batch, through the internal launch, standard and (NCHW)
            // image-interleaved layouts.
            if s.n < 2 {
                continue;
            }
            let x = upload::<T>(ctx, &xv[..s.x_len().unwrap()]);
            let want = r::im2col(&s, &xv[..s.x_len().unwrap()]).unwrap();
            let (b0, nb) = (1, s.n - 1);
            let layouts = match format {
                Nchw => vec![
                    ColLayout::standard(p, k),
                    ColLayout {
                        img: p,
                        row: nb * p,
                    },
                ],
                Nhwc => vec![ColLayout::standard(p, k)],
            };
            for layout in layouts {
                let mut cols = poisoned::<T>(ctx, nb * p * k);
                let xp = ptr(ctx, &x) + (b0 * s.c_in * s.h * s.w * dt.size()) as u64;
                let cp = ptr_mut(ctx, &mut cols);
                let l = launch::im2col(&s, layout, dt.size(), nb, xp, cp).unwrap();
                // SAFETY: x holds images b0.. of s; cols holds nb images' columns.
                unsafe { launch_cols(ctx, &l, xp, cp).unwrap() };
                let got = download(ctx, &cols);
                for b in 0..nb {
                    for q in 0..k {
                        for px in 0..p {
                            let g = match format {
                                Nchw => got[b * layout.img + q * layout.row + px],
                                Nhwc => got[(b * p + px) * k + q],
                            };
                            let w = match format {
                                Nchw => want[((b0 + b) * k + q) * p + px],
                                Nhwc => want[((b0 + b) * p + px) * k + q],
                            };
                            assert!(
                                g.to_bits() == w.to_bits(),
                                "im2col chunk {dt} {s:?} {layout:?} ({}): image {b} tap {q} \
                                 pixel {px}: got {g} want {w}",
                                l.kernel
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn im2col_kernel_is_the_reference_bit_for_bit() {
    let ctx = gpu_with(Config::default());
    let mut rng = Rng::fresh("im2col_kernel_is_the_reference_bit_for_bit");
    im2col_bitwise::<f32>(&ctx, &mut rng);
    im2col_bitwise::<f16>(&ctx, &mut rng);
    im2col_bitwise::<bf16>(&ctx, &mut rng);
}

/// The public col2im against the reference (f32 sums of exactly representable inputs), every
/// data type, both formats, the columns and x aligned and either one element off (every unit
/// width of the NHWC kernels).
#[test]
#[ignore = "needs a CUDA GPU"]
fn col2im_kernel_matches_the_reference() {
    fn run<T: Element>(ctx: &Context, rng: &mut Rng) {
        for format in [Nchw, Nhwc] {
            for s in shapes(format) {
                let n_cols = super::columns_len(&s).unwrap();
                let cv = quantized(rng, n_cols + 1);
                for (skew, cskew) in [(0usize, 0usize), (1, 0), (0, 1)] {
                    let want = r::col2im(&s, &cv[cskew..cskew + n_cols]).unwrap();
                    let cols = upload::<T>(ctx, &cv);
                    let mut x = poisoned::<T>(ctx, s.x_len().unwrap() + 1);
                    let es = T::DTYPE.size() as u64;
                    let (ca, xa) = (
                        ptr(ctx, &cols) + cskew as u64 * es,
                        ptr_mut(ctx, &mut x) + skew as u64 * es,
                    );
                    let kernel = launch::col2im(&s, T::DTYPE, s.n, ca, xa, false)
                        .unwrap()
                        .kernel;
                    let mut view = x.slice_mut(skew..skew + s.x_len().unwrap());
                    super::col2im(ctx, &s, &cols.slice(cskew..cskew + n_cols), &mut view).unwrap();
                    let got = download(ctx, &x);
                    let what = format!(
                        "col2im {} {s:?} x skew {skew} cols skew {cskew} ({kernel})",
                        T::DTYPE
                    );
                    check(
                        &what,
                        &got[skew..skew + s.x_len().unwrap()],
                        &want,
                        T::DTYPE.tolerance(),
                    );
                    let outside = if skew == 0 {
                        got[s.x_len().unwrap()]
                    } else {
                        got[0]
                    };
                    assert!(outside.is_nan(), "{what}: wrote outside x");
                }
            }
        }
    }
    let ctx = gpu_with(Config::default());
    let mut rng = Rng::fresh("col2im_kernel_matches_the_reference");
    run::<f32>(&ctx, &mut rng);
    run::<f16>(&ctx, &mut rng);
    run::<bf16>(&ctx, &mut rng);
}

/// Forward, data gradient and filter gradient (each overwrite and accumulate) of the path against
/// the f64 references, on poisoned outputs; data and filter gradients run twice and must agree
/// bit for bit (col2im's gather and the f32 chunk accumulation are deterministic).
fn path_case<T: Element>(ctx: &Context, c: &Case, label: &str) -> usize {
    let dt = T::DTYPE;
    let tol = dt.tolerance();
    let s = &c.s;
    let what = |op: &str| format!("{label} {dt} {op} {s:?}");
    let x = upload::<T>(ctx, &c.x);
    let w = upload::<T>(ctx, &c.w);
    let dy = upload::<T>(ctx, &c.dy);
    // Forward.
    let mut y = poisoned::<T>(ctx, c.y.len());
    let fp = FwdPtrs {
        x: ptr(ctx, &x),
        w: ptr(ctx, &w),
        y: ptr_mut(ctx, &mut y),
    };
    // SAFETY: buffers of the problem's extents, y disjoint.
    unsafe { forward(ctx, s, dt, fp) }.unwrap_or_else(|e| panic!("{}: {e}", what("forward")));
    check(&what("forward y"), &download(ctx, &y), &c.y, tol);
    // Data gradient: overwrite (twice) and accumulate (onto x's values, nonzero and of dx's
    // length).
    let mut runs = Vec::new();
    for accumulate in [false, false, true] {
        let mut dx = if accumulate {
            upload::<T>(ctx, &c.x)
        } else {
            poisoned::<T>(ctx, c.dx.len())
        };
        let p = BwdDataPtrs {
            dy: ptr(ctx, &dy),
            w: ptr(ctx, &w),
            dx: ptr_mut(ctx, &mut dx),
        };
        // SAFETY: as above.
        unsafe { backward_data(ctx, s, dt, p, accumulate) }
            .unwrap_or_else(|e| panic!("{}: {e}", what("backward_data")));
        runs.push(download(ctx, &dx));
    }
    let want_acc: Vec<f64> = c.dx.iter().zip(&c.x).map(|(a, b)| a + b).collect();
    check(
        &what("backward_data dx += (accumulate)"),
        &runs[2],
        &want_acc,
        tol,
    );
    check(&what("backward_data dx"), &runs[0], &c.dx, tol);
    assert!(
        runs[0]
            .iter()
            .zip(&runs[1])
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{}: two runs differ",
        what("backward_data")
    );
    // Filter gradient: overwrite (twice) and accumulate.
    let mut runs = Vec::new();
    for accumulate in [false, false, true] {
        let mut dw = if accumulate {
            upload::<T>(ctx, &c.old_dw)
        } else {
            poisoned::<T>(ctx, c.dw.len())
        };
        let p = BwdFilterPtrs {
            x: ptr(ctx, &x),
            dy: ptr(ctx, &dy),
            dw: ptr_mut(ctx, &mut dw),
        };
        // SAFETY: as above.
        unsafe { backward_filter(ctx, s, dt, p, accumulate) }
            .unwrap_or_else(|e| panic!("{}: {e}", what("backward_filter")));
        runs.push(download(ctx, &dw));
    }
    check(&what("backward_filter dw"), &runs[0], &c.dw, tol);
    assert!(
        runs[0]
            .iter()
            .zip(&runs[1])
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{}: two runs differ",
        what("backward_filter")
    );
    let want_acc: Vec<f64> = c.dw.iter().zip(&c.old_dw).map(|(a, b)| a + b).collect();
    check(
        &what("backward_filter dw += (accumulate)"),
        &runs[2],
        &want_acc,
        tol,
    );
    let plan = super::steps::forward(s, dt, ctx.config().conv_workspace_bytes()).unwrap();
    plan.chunks.len()
}

fn path_all(ctx: &Context, label: &str, rng: &mut Rng) -> HashMap<usize, usize> {
    let mut chunk_counts = HashMap::new();
    for format in [Nchw, Nhwc] {
        for c in cases(rng, &shapes(format)) {
            for chunks in [
                path_case::<f32>(ctx, &c, label),
                path_case::<f16>(ctx, &c, label),
                path_case::<bf16>(ctx, &c, label),
            ] {
                *chunk_counts.entry(chunks).or_insert(0) += 1;
            }
        }
    }
    chunk_counts
}

/// The whole path with the default 256 MiB cap (one chunk) and with a 1 MiB cap (several
/// chunks on the larger problems, so that chunk offsets and the f32 accumulation across chunks
/// run). The GEMM search is off here (the cuBLAS default): the path's logic does not depend on
/// the algorithm, and the search runs in `path_with_the_gemm_search`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn path_matches_the_references() {
    let mut rng = Rng::fresh("path_matches_the_references");
    let ctx = gpu_with(Config::default().with_gemm_search(false));
    let one = path_all(&ctx, "cap 256 MiB", &mut rng);
    assert_eq!(one.keys().copied().collect::<Vec<_>>(), vec![1], "{one:?}");
    let ctx = gpu_with(
        Config::default()
            .with_gemm_search(false)
            .with_conv_workspace_mb(1),
    );
    let many = path_all(&ctx, "cap 1 MiB", &mut rng);
    assert!(
        many.keys().any(|&k| k > 1),
        "no problem was chunked: {many:?}"
    );
}

/// One chunked problem per format with the GEMM search on (it searches on the scratch
/// operands the raw GEMM entry gets).
#[test]
#[ignore = "needs a CUDA GPU"]
fn path_with_the_gemm_search() {
    let mut rng = Rng::fresh("path_with_the_gemm_search");
    let ctx = gpu_with(Config::default().with_conv_workspace_mb(1));
    for format in [Nchw, Nhwc] {
        let cs = cases(&mut rng, &shapes(format)[..1]);
        assert!(path_case::<f16>(&ctx, &cs[0], "search on") > 1);
        path_case::<f32>(&ctx, &cs[0], "search on");
    }
}

/// A problem whose one image's columns exceed the cap is refused before anything runs, naming
/// the cap's variable; the output is left as it was.
#[test]
#[ignore = "needs a CUDA GPU"]
fn over_the_cap_is_not_supported_and_launches_nothing() {
    let ctx = gpu_with(Config::default().with_conv_workspace_mb(1));
    // 64 channels, 3x3, 64x64: 4096 * 576 * 4 bytes = 9 MiB of columns per image.
    let s = shape(1, 64, (64, 64), 8, (3, 3), (1, 1), (1, 1), (1, 1), Nhwc);
    let x = upload::<f32>(&ctx, &vec![1.0; s.x_len().unwrap()]);
    let w = upload::<f32>(&ctx, &vec![1.0; s.w_len().unwrap()]);
    let mut y = upload::<f32>(&ctx, &vec![7.0; s.y_len().unwrap()]);
    let p = FwdPtrs {
        x: ptr(&ctx, &x),
        w: ptr(&ctx, &w),
        y: ptr_mut(&ctx, &mut y),
    };
    // SAFETY: buffers of the problem's extents.
    let e = unsafe { forward(&ctx, &s, DType::F32, p) }.unwrap_err();
    assert!(e.to_string().contains("NNFUSE_CONV_WORKSPACE_MB"), "{e}");
    assert!(download(&ctx, &y).iter().all(|&v| v == 7.0));
}

/// The public functions check their arguments before launching.
#[test]
#[ignore = "needs a CUDA GPU"]
fn public_kernels_validate() {
    let ctx = gpu_with(Config::default());
    let s = shape(2, 3, (5, 5), 4, (3, 3), (1, 1), (1, 1), (1, 1), Nchw);
    let n_cols = super::columns_len(&s).unwrap();
    let x = upload::<f32>(&ctx, &vec![1.0; s.x_len().unwrap()]);
    let mut cols = upload::<f32>(&ctx, &vec![3.0; n_cols + 1]);
    let e = super::im2col(&ctx, &s, &x, &mut cols).unwrap_err();
    assert_eq!(e.argument(), Some("cols"), "{e}");
    let mut short = upload::<f32>(&ctx, &vec![3.0; s.x_len().unwrap() - 1]);
    let e = super::col2im(&ctx, &s, &cols.slice(..n_cols), &mut short).unwrap_err();
    assert_eq!(e.argument(), Some("x"), "{e}");
    let bad = ConvShape { kh: 9, ..s };
    assert_eq!(
        super::im2col(&ctx, &bad, &x, &mut cols)
            .unwrap_err()
            .argument(),
        Some("kh")
    );
    assert!(download(&ctx, &cols).iter().all(|&v| v == 3.0));
}
