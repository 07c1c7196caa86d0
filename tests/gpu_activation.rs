//! GPU tests of the bitmask ReLU / Add+ReLU kernels against `nnfuse::reference::activation`:
//! masks bit for bit, y / dx / dz exactly (ReLU is exact; Add+ReLU rounds one f32 sum, which
//! equals the f64 reference rounded to the element type). Every length class (0, < one word,
//! word boundaries, partial vector chunks, 10^7+3), both paths (aligned views take the 16-byte
//! path, views at odd offsets the scalar one), every dtype, in place, NaN / ±0 / ±inf, and the
//! launchers' argument errors. Outputs are poisoned first, and the poison around every view is
//! checked afterwards (no write outside the view, no mask word past ceil(n/32)).

mod common;

use common::*;
use cudarc::driver::{CudaSlice, DevicePtr};
use half::{bf16, f16};
use nnfuse::activation::{self, baseline, mask_words, NoMask};
use nnfuse::internals::util;
use nnfuse::reference::activation as reference;
use nnfuse::{Context, Element};

/// Never a ReLU output nor a gradient in the tests' data range; exact in f32, f16 and bf16.
const POISON: f64 = -768.0;
const MASK_POISON: u32 = 0xFFFF_FFFF;
const MASK_POISON_2: u32 = 0xA5A5_5A5A;

/// Random values in [-4, 4) with exact +0 and -0 mixed in (about 4% each) and, when `specials`,
/// NaN, +inf and -inf (about 1% each).
fn sample<T: Element>(rng: &mut Rng, n: usize, specials: bool) -> Vec<T> {
    (0..n)
        .map(|_| {
            let u = rng.uniform(0.0, 1.0);
            let v = if u < 0.04 {
                0.0
            } else if u < 0.08 {
                -0.0
            } else if specials && u < 0.09 {
                f64::NAN
            } else if specials && u < 0.10 {
                f64::INFINITY
            } else if specials && u < 0.11 {
                f64::NEG_INFINITY
            } else {
                rng.uniform(-4.0, 4.0)
            };
            T::from_f64(v)
        })
        .collect()
}

/// `x` placed at `off` in a buffer of random values with 7 more after it (so that a view of it
/// starts `off` elements into the allocation).
fn upload_at<T: Element>(ctx: &Context, rng: &mut Rng, x: &[T], off: usize) -> CudaSlice<T> {
    let mut host: Vec<T> = rng.vec(off + x.len() + 7, -4.0, 4.0);
    host[off..off + x.len()].copy_from_slice(x);
    ctx.stream().clone_htod(&host).unwrap()
}

/// A poisoned output buffer of `off + n + 7` elements.
fn poisoned<T: Element>(ctx: &Context, n: usize, off: usize) -> CudaSlice<T> {
    let mut b = ctx.stream().alloc_zeros::<T>(off + n + 7).unwrap();
    util::fill(ctx, &mut b, T::from_f64(POISON)).unwrap();
    b
}

/// A poisoned mask buffer: `off` words, then `mask_words(n)` + 3 (the view handed to the
/// kernel is all of it after `off`, longer than needed).
fn poisoned_mask(ctx: &Context, n: usize, off: usize, value: u32) -> CudaSlice<u32> {
    let mut b = ctx
        .stream()
        .alloc_zeros::<u32>(off + mask_words(n) + 3)
        .unwrap();
    util::fill_u32(ctx, &mut b, value).unwrap();
    b
}

fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
    ctx: &Context,
    b: &CudaSlice<T>,
) -> Vec<T> {
    ctx.stream().clone_dtoh(b).unwrap()
}

/// The reference values rounded to `T` (exactly representable, so comparing is exact).
fn in_t<T: Element>(v: &[f64]) -> Vec<f64> {
    v.iter().map(|&x| T::from_f64(x).to_f64()).collect()
}

/// Element `off + i` of `got` equals `want[i]` exactly (same sign of zero; NaN matches NaN), and
/// every element outside `off..off + want.len()` is still the poison.
fn assert_view<T: Element>(what: &str, got: &[T], off: usize, want: &[f64]) {
    let n = want.len();
    for (i, g) in got.iter().enumerate() {
        let g = g.to_f64();
        if i < off || i >= off + n {
            assert_eq!(
                g,
                POISON,
                "{what} ({:?}, n={n}, off={off}): element {i} outside the view was written",
                T::DTYPE
            );
            continue;
        }
        let w = want[i - off];
        let ok = if w.is_nan() {
            g.is_nan()
        } else {
            g == w && g.is_sign_negative() == w.is_sign_negative()
        };
        assert!(
            ok,
            "{what} ({:?}, n={n}, off={off}): element {} is {g:?}, want {w:?}",
            T::DTYPE,
            i - off
        );
    }
}

/// Words `off .. off + mask_words(n)` equal `want` bit for bit; the rest is still `poison`.
fn assert_mask(what: &str, got: &[u32], off: usize, want: &[u32], poison: u32) {
    for (i, &g) in got.iter().enumerate() {
        if i < off || i >= off + want.len() {
            assert_eq!(
                g,
                poison,
                "{what}: mask word {i} outside the first ceil(n/32) = {} words of the view was \
                 written (view offset {off})",
                want.len()
            );
        } else {
            assert_eq!(
                g,
                want[i - off],
                "{what}: mask word {} is {g:#034b}, want {:#034b}",
                i - off,
                want[i - off]
            );
        }
    }
}

/// Offsets (elements) of each buffer's view into its allocation. Offset 0 is 256-byte aligned
/// (cudarc allocations), so all-zero offsets take the vector path; any odd offset, the scalar.
#[derive(Debug, Clone, Copy)]
struct Offsets {
    x: usize,
    z: usize,
    y: usize,
    m: usize,
}

/// Every non-in-place launcher on one case, against the reference.
fn check_case<T: Element>(ctx: &Context, rng: &mut Rng, n: usize, o: Offsets) {
    let tag = format!("{:?} n={n} {o:?}", T::DTYPE);
    let x: Vec<T> = sample(rng, n, true);
    let mut z: Vec<T> = sample(rng, n, true);
    // Some exact cancellations: x + z == 0 exactly (bit 0, y = +0).
    for i in (0..n).step_by(29) {
        z[i] = T::from_f64(-x[i].to_f64());
    }
    let dy: Vec<T> = sample(rng, n, false);
    let (xf, zf, dyf) = (f64s(&x), f64s(&z), f64s(&dy));
    let xd = upload_at(ctx, rng, &x, o.x);
    let zd = upload_at(ctx, rng, &z, o.z);
    let dyd = upload_at(ctx, rng, &dy, o.x);
    let xv = xd.slice(o.x..o.x + n);
    let zv = zd.slice(o.z..o.z + n);
    let dyv = dyd.slice(o.x..o.x + n);

    // ReLU forward, with mask.
    let (want_y, want_m) = reference::relu_mask_fwd(&xf);
    let mut y = poisoned::<T>(ctx, n, o.y);
    let mut m = poisoned_mask(ctx, n, o.m, MASK_POISON);
    activation::relu_mask_fwd(
        ctx,
        &xv,
        &mut y.slice_mut(o.y..o.y + n),
        Some(&mut m.slice_mut(o.m..)),
    )
    .unwrap();
    assert_view(&format!("relu y {tag}"), &download(ctx, &y), o.y, &want_y);
    let relu_mask = download(ctx, &m);
    assert_mask(
        &format!("relu mask {tag}"),
        &relu_mask,
        o.m,
        &want_m,
        MASK_POISON,
    );

    // ReLU forward, no mask (inference).
    let mut y = poisoned::<T>(ctx, n, o.y);
    activation::relu_mask_fwd(
        ctx,
        &xv,
        &mut y.slice_mut(o.y..o.y + n),
        None::<&mut NoMask>,
    )
    .unwrap();
    assert_view(
        &format!("relu y (no mask) {tag}"),
        &download(ctx, &y),
        o.y,
        &want_y,
    );

    // Naive baseline: the same y and mask.
    let mut y = poisoned::<T>(ctx, n, o.y);
    let mut m = poisoned_mask(ctx, n, o.m, MASK_POISON_2);
    baseline::relu_mask_fwd_naive8(
        ctx,
        &xv,
        &mut y.slice_mut(o.y..o.y + n),
        &mut m.slice_mut(o.m..),
    )
    .unwrap();
    assert_view(&format!("naive8 y {tag}"), &download(ctx, &y), o.y, &want_y);
    assert_mask(
        &format!("naive8 mask {tag}"),
        &download(ctx, &m),
        o.m,
        &want_m,
        MASK_POISON_2,
    );

    // Add+ReLU forward.
    let (want_ay, want_am) = reference::add_relu_mask_fwd(&xf, &zf).unwrap();
    let want_ay = in_t::<T>(&want_ay);
    let mut y = poisoned::<T>(ctx, n, o.y);
    let mut m = poisoned_mask(ctx, n, o.m, MASK_POISON);
    activation::add_relu_mask_fwd(
        ctx,
        &xv,
        &zv,
        &mut y.slice_mut(o.y..o.y + n),
        Some(&mut m.slice_mut(o.m..)),
    )
    .unwrap();
    assert_view(
        &format!("add-relu y {tag}"),
        &download(ctx, &y),
        o.y,
        &want_ay,
    );
    assert_mask(
        &format!("add-relu mask {tag}"),
        &download(ctx, &m),
        o.m,
        &want_am,
        MASK_POISON,
    );
    let mut y = poisoned::<T>(ctx, n, o.y);
    activation::add_relu_mask_fwd(
        ctx,
        &xv,
        &zv,
        &mut y.slice_mut(o.y..o.y + n),
        None::<&mut NoMask>,
    )
    .unwrap();
    assert_view(
        &format!("add-relu y (no mask) {tag}"),
        &download(ctx, &y),
        o.y,
        &want_ay,
    );

    // Backward from the Add+ReLU mask, with garbage in the tail bits of its last word (they
    // must be ignored) and the mask view at offset o.m.
    let mut mask_in = want_am.clone();
    if n % 32 != 0 {
        if let Some(last) = mask_in.last_mut() {
            *last |= !0u32 << (n % 32);
        }
    }
    let mut mhost: Vec<u32> = vec![0x0F0F_0F0F; o.m + mask_in.len() + 2];
    mhost[o.m..o.m + mask_in.len()].copy_from_slice(&mask_in);
    let md = ctx.stream().clone_htod(&mhost).unwrap();
    let mv = md.slice(o.m..o.m + mask_in.len());
    let want_dx = reference::relu_mask_bwd(&dyf, &want_am).unwrap();
    let mut dx = poisoned::<T>(ctx, n, o.y);
    activation::relu_mask_bwd(ctx, &dyv, &mv, &mut dx.slice_mut(o.y..o.y + n)).unwrap();
    assert_view(&format!("bwd dx {tag}"), &download(ctx, &dx), o.y, &want_dx);

    // Dual backward: dz at a different offset (one of dx/dz may be misaligned).
    let mut dx = poisoned::<T>(ctx, n, o.y);
    let mut dz = poisoned::<T>(ctx, n, o.z);
    activation::relu_mask_bwd_dual(
        ctx,
        &dyv,
        &mv,
        &mut dx.slice_mut(o.y..o.y + n),
        &mut dz.slice_mut(o.z..o.z + n),
    )
    .unwrap();
    assert_view(
        &format!("dual dx {tag}"),
        &download(ctx, &dx),
        o.y,
        &want_dx,
    );
    assert_view(
        &format!("dual dz {tag}"),
        &download(ctx, &dz),
        o.z,
        &want_dx,
    );

    // The y-based baseline on the ReLU output gives the ReLU mask's gradient.
    let want_dx_relu = reference::relu_mask_bwd(&dyf, &want_m).unwrap();
    let yd = upload_at(ctx, rng, &y_as_t::<T>(&want_y), o.z);
    let mut dx = poisoned::<T>(ctx, n, o.y);
    baseline::relu_bwd_from_y(
        ctx,
        &dyv,
        &yd.slice(o.z..o.z + n),
        &mut dx.slice_mut(o.y..o.y + n),
    )
    .unwrap();
    assert_view(
        &format!("y-bwd dx {tag}"),
        &download(ctx, &dx),
        o.y,
        &want_dx_relu,
    );
    // ... and the mask the GPU made drives the mask backward to the same result.
    let gpu_mask = ctx
        .stream()
        .clone_htod(&relu_mask[o.m..o.m + mask_words(n)])
        .unwrap();
    let mut dx = poisoned::<T>(ctx, n, o.y);
    activation::relu_mask_bwd(ctx, &dyv, &gpu_mask, &mut dx.slice_mut(o.y..o.y + n)).unwrap();
    assert_view(
        &format!("bwd(gpu mask) dx {tag}"),
        &download(ctx, &dx),
        o.y,
        &want_dx_relu,
    );
}

fn y_as_t<T: Element>(y: &[f64]) -> Vec<T> {
    y.iter().map(|&v| T::from_f64(v)).collect()
}

const LENGTHS: [usize; 7] = [1, 31, 32, 33, 1023, 4097, 10_000_003];

fn lengths_and_offsets<T: Element>(ctx: &Context, tag: &str) {
    let mut rng = Rng::fresh(tag);
    let aligned = Offsets {
        x: 0,
        z: 0,
        y: 0,
        m: 0,
    };
    // A second aligned case through views: offsets that are whole 16-byte vectors for every
    // dtype (f32: 4 elements, halves: 8).
    let aligned_views = Offsets {
        x: 8,
        z: 16,
        y: 24,
        m: 1,
    };
    let odd = Offsets {
        x: 1,
        z: 3,
        y: 5,
        m: 3,
    };
    let mixed = Offsets {
        x: 0,
        z: 0,
        y: 3,
        m: 0,
    }; // only y misaligned
    let mixed2 = Offsets {
        x: 0,
        z: 1,
        y: 0,
        m: 2,
    }; // only z misaligned
    for n in LENGTHS {
        let cases: &[Offsets] = if n > 1_000_000 {
            &[aligned, odd]
        } else {
            &[aligned, aligned_views, odd, mixed, mixed2]
        };
        for &o in cases {
            check_case::<T>(ctx, &mut rng, n, o);
        }
    }
    // Lengths around every chunk and tile boundary (vector chunks: 128 f32 / 256 half elements,
    // 2 per warp; scalar tiles: 256 elements).
    for n in [
        127, 128, 129, 255, 256, 257, 511, 512, 513, 767, 768, 1024, 1025, 65_537,
    ] {
        for &o in &[aligned, odd] {
            check_case::<T>(ctx, &mut rng, n, o);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn matches_reference_f32() {
    lengths_and_offsets::<f32>(&gpu(), "bitmask f32");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn matches_reference_f16() {
    lengths_and_offsets::<f16>(&gpu(), "bitmask f16");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn matches_reference_bf16() {
    lengths_and_offsets::<bf16>(&gpu(), "bitmask bf16");
}

fn in_place<T: Element>(ctx: &Context, rng: &mut Rng, n: usize, off: usize) {
    let tag = format!("in place {:?} n={n} off={off}", T::DTYPE);
    let x: Vec<T> = sample(rng, n, true);
    let z: Vec<T> = sample(rng, n, true);
    let dy: Vec<T> = sample(rng, n, false);
    let (xf, zf, dyf) = (f64s(&x), f64s(&z), f64s(&dy));
    // The buffers around the view are poisoned so that a stray write shows.
    let place = |v: &[T]| {
        let mut host = vec![T::from_f64(POISON); off + n + 7];
        host[off..off + n].copy_from_slice(v);
        ctx.stream().clone_htod(&host).unwrap()
    };

    let (want_y, want_m) = reference::relu_mask_fwd(&xf);
    let mut xy = place(&x);
    let mut m = poisoned_mask(ctx, n, 0, MASK_POISON);
    activation::relu_mask_fwd_inplace(ctx, &mut xy.slice_mut(off..off + n), Some(&mut m)).unwrap();
    assert_view(&format!("relu {tag}"), &download(ctx, &xy), off, &want_y);
    assert_mask(
        &format!("relu mask {tag}"),
        &download(ctx, &m),
        0,
        &want_m,
        MASK_POISON,
    );
    let mut xy = place(&x);
    activation::relu_mask_fwd_inplace(ctx, &mut xy.slice_mut(off..off + n), None::<&mut NoMask>)
        .unwrap();
    assert_view(
        &format!("relu (no mask) {tag}"),
        &download(ctx, &xy),
        off,
        &want_y,
    );

    let (want_ay, want_am) = reference::add_relu_mask_fwd(&xf, &zf).unwrap();
    let want_ay = in_t::<T>(&want_ay);
    let mut xy = place(&x);
    let zd = ctx.stream().clone_htod(&z).unwrap();
    let mut m = poisoned_mask(ctx, n, 0, MASK_POISON);
    activation::add_relu_mask_fwd_inplace(ctx, &mut xy.slice_mut(off..off + n), &zd, Some(&mut m))
        .unwrap();
    assert_view(
        &format!("add-relu {tag}"),
        &download(ctx, &xy),
        off,
        &want_ay,
    );
    assert_mask(
        &format!("add-relu mask {tag}"),
        &download(ctx, &m),
        0,
        &want_am,
        MASK_POISON,
    );

    let want_dx = reference::relu_mask_bwd(&dyf, &want_am).unwrap();
    let mut g = place(&dy);
    let md = ctx.stream().clone_htod(&want_am).unwrap();
    activation::relu_mask_bwd_inplace(ctx, &mut g.slice_mut(off..off + n), &md).unwrap();
    assert_view(&format!("bwd {tag}"), &download(ctx, &g), off, &want_dx);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn in_place_every_dtype() {
    let ctx = gpu();
    let mut rng = Rng::fresh("bitmask in place");
    for n in [1, 31, 33, 1023, 4097, 1_000_003] {
        for off in [0, 1, 8] {
            in_place::<f32>(&ctx, &mut rng, n, off);
            in_place::<f16>(&ctx, &mut rng, n, off);
            in_place::<bf16>(&ctx, &mut rng, n, off);
        }
    }
}

/// Raw-pointer aliases: a second `CudaSlice` over the memory of `b` starting `off` elements in
/// (`len` elements). The caller must `leak()` it (the memory belongs to `b`).
fn alias<T, U>(ctx: &Context, b: &CudaSlice<T>, off_bytes: u64, len: usize) -> CudaSlice<U> {
    let (p, _s) = b.device_ptr(ctx.stream());
    // SAFETY: inside b's allocation (callers keep off_bytes + len * size within it); leaked by
    // the caller so that it is never freed twice.
    unsafe { ctx.stream().upgrade_device_ptr::<U>(p + off_bytes, len) }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn exact_aliasing_through_raw_pointers() {
    // y == x and dx == dy passed as two distinct handles: documented as supported.
    let ctx = gpu();
    let mut rng = Rng::fresh("bitmask exact alias");
    for n in [33, 4097] {
        for off in [0usize, 1] {
            let x: Vec<f32> = sample(&mut rng, n, true);
            let z: Vec<f32> = sample(&mut rng, n, true);
            let (want_y, want_m) = reference::relu_mask_fwd(&f64s(&x));
            let mut host = vec![POISON as f32; off + n + 7];
            host[off..off + n].copy_from_slice(&x);
            let buf = ctx.stream().clone_htod(&host).unwrap();
            let mut y = alias::<f32, f32>(&ctx, &buf, 4 * off as u64, n);
            let mut m = ctx.stream().alloc_zeros::<u32>(mask_words(n)).unwrap();
            activation::relu_mask_fwd(&ctx, &buf.slice(off..off + n), &mut y, Some(&mut m))
                .unwrap();
            ctx.synchronize().unwrap();
            y.leak();
            assert_view("aliased relu", &download(&ctx, &buf), off, &want_y);
            assert_eq!(download(&ctx, &m), want_m);

            // Add+ReLU with y == z.
            let (want_ay, _) = reference::add_relu_mask_fwd(&f64s(&x), &f64s(&z)).unwrap();
            let xd = ctx.stream().clone_htod(&x).unwrap();
            let mut host = vec![POISON as f32; off + n + 7];
            host[off..off + n].copy_from_slice(&z);
            let zbuf = ctx.stream().clone_htod(&host).unwrap();
            let mut y = alias::<f32, f32>(&ctx, &zbuf, 4 * off as u64, n);
            activation::add_relu_mask_fwd(
                &ctx,
                &xd,
                &zbuf.slice(off..off + n),
                &mut y,
                None::<&mut NoMask>,
            )
            .unwrap();
            ctx.synchronize().unwrap();
            y.leak();
            assert_view(
                "aliased add-relu",
                &download(&ctx, &zbuf),
                off,
                &in_t::<f32>(&want_ay),
            );

            // Dual backward with dx == dy.
            let dy: Vec<f32> = sample(&mut rng, n, false);
            let want = reference::relu_mask_bwd(&f64s(&dy), &want_m).unwrap();
            let mut host = vec![POISON as f32; off + n + 7];
            host[off..off + n].copy_from_slice(&dy);
            let gbuf = ctx.stream().clone_htod(&host).unwrap();
            let mut dx = alias::<f32, f32>(&ctx, &gbuf, 4 * off as u64, n);
            let mut dz = poisoned::<f32>(&ctx, n, 0);
            activation::relu_mask_bwd_dual(
                &ctx,
                &gbuf.slice(off..off + n),
                &m,
                &mut dx,
                &mut dz.slice_mut(0..n),
            )
            .unwrap();
            ctx.synchronize().unwrap();
            dx.leak();
            assert_view("aliased dual dx", &download(&ctx, &gbuf), off, &want);
            assert_view("aliased dual dz", &download(&ctx, &dz), 0, &want);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nan_inf_and_signed_zeros() {
    let ctx = gpu();
    let mut rng = Rng::fresh("bitmask nan");
    let specials = [
        f64::NAN,
        -f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        0.0,
        -0.0,
        1.0,
        -1.0,
    ];
    fn run<T: Element>(ctx: &Context, rng: &mut Rng, specials: &[f64]) {
        for off in [0usize, 1] {
            let n = 1000;
            // Every pair of specials at some position, between random values.
            let mut xf: Vec<f64> = (0..n).map(|_| rng.uniform(-2.0, 2.0)).collect();
            let mut zf: Vec<f64> = (0..n).map(|_| rng.uniform(-2.0, 2.0)).collect();
            let mut i = 0;
            for &a in specials {
                for &b in specials {
                    xf[i * 7 % n] = a;
                    zf[i * 7 % n] = b;
                    i += 1;
                }
            }
            let x: Vec<T> = xf.iter().map(|&v| T::from_f64(v)).collect();
            let z: Vec<T> = zf.iter().map(|&v| T::from_f64(v)).collect();
            let (xf, zf) = (f64s(&x), f64s(&z));
            let xd = upload_at(ctx, rng, &x, off);
            let zd = upload_at(ctx, rng, &z, off);
            let (want_y, want_m) = reference::relu_mask_fwd(&xf);
            let mut y = poisoned::<T>(ctx, n, off);
            let mut m = poisoned_mask(ctx, n, 0, MASK_POISON);
            activation::relu_mask_fwd(
                ctx,
                &xd.slice(off..off + n),
                &mut y.slice_mut(off..off + n),
                Some(&mut m),
            )
            .unwrap();
            let got = download(ctx, &y);
            assert_view("nan relu", &got, off, &want_y);
            assert_mask("nan relu mask", &download(ctx, &m), 0, &want_m, MASK_POISON);
            for (i, v) in xf.iter().enumerate() {
                if v.is_nan() {
                    assert!(got[off + i].to_f64().is_nan());
                    assert!(!reference::mask_bit(&want_m, i).unwrap());
                }
            }
            let (want_ay, want_am) = reference::add_relu_mask_fwd(&xf, &zf).unwrap();
            let mut y = poisoned::<T>(ctx, n, off);
            let mut m = poisoned_mask(ctx, n, 0, MASK_POISON);
            activation::add_relu_mask_fwd(
                ctx,
                &xd.slice(off..off + n),
                &zd.slice(off..off + n),
                &mut y.slice_mut(off..off + n),
                Some(&mut m),
            )
            .unwrap();
            assert_view(
                "nan add-relu",
                &download(ctx, &y),
                off,
                &in_t::<T>(&want_ay),
            );
            assert_mask(
                "nan add-relu mask",
                &download(ctx, &m),
                0,
                &want_am,
                MASK_POISON,
            );
        }
    }
    run::<f32>(&ctx, &mut rng, &specials);
    run::<f16>(&ctx, &mut rng, &specials);
    run::<bf16>(&ctx, &mut rng, &specials);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn zero_length_is_a_no_op() {
    // Empty views of non-empty buffers (a zero-byte allocation is itself an error in CUDA).
    let ctx = gpu();
    let s = ctx.stream();
    let xb = s.clone_htod(&[1.0f32; 4]).unwrap();
    let mut yb = s.clone_htod(&[POISON as f32; 4]).unwrap();
    let mut zb = s.clone_htod(&[POISON as f32; 4]).unwrap();
    let mut mb = s.clone_htod(&[MASK_POISON; 2]).unwrap();
    {
        let x = xb.slice(0..0);
        let mut y = yb.slice_mut(0..0);
        let mut m = mb.slice_mut(0..0);
        activation::relu_mask_fwd(&ctx, &x, &mut y, Some(&mut m)).unwrap();
        activation::add_relu_mask_fwd(&ctx, &x, &x, &mut y, Some(&mut m)).unwrap();
        activation::relu_mask_fwd_inplace(&ctx, &mut y, None::<&mut NoMask>).unwrap();
        activation::add_relu_mask_fwd_inplace(&ctx, &mut y, &x, Some(&mut m)).unwrap();
        baseline::relu_mask_fwd_naive8(&ctx, &x, &mut y, &mut m).unwrap();
        baseline::relu_bwd_from_y(&ctx, &x, &x, &mut y).unwrap();
    }
    {
        let x = xb.slice(0..0);
        let m = mb.slice(0..0);
        let mut y = yb.slice_mut(0..0);
        let mut dz = zb.slice_mut(0..0);
        activation::relu_mask_bwd(&ctx, &x, &m, &mut y).unwrap();
        activation::relu_mask_bwd_dual(&ctx, &x, &m, &mut y, &mut dz).unwrap();
        activation::relu_mask_bwd_inplace(&ctx, &mut y, &m).unwrap();
    }
    ctx.synchronize().unwrap();
    assert_eq!(mask_words(0), 0);
    assert_eq!(download(&ctx, &yb), vec![POISON as f32; 4]);
    assert_eq!(download(&ctx, &zb), vec![POISON as f32; 4]);
    assert_eq!(download(&ctx, &mb), vec![MASK_POISON; 2]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_arguments_are_named() {
    let ctx = gpu();
    let mut rng = Rng::fresh("bitmask errors");
    let s = ctx.stream();
    let x = s.clone_htod(&rng.vec::<f32>(12, -1.0, 1.0)).unwrap();
    let z10 = s.clone_htod(&rng.vec::<f32>(10, -1.0, 1.0)).unwrap();
    let mut y = s.alloc_zeros::<f32>(12).unwrap();
    let mut y10 = s.alloc_zeros::<f32>(10).unwrap();
    let mut m = s.alloc_zeros::<u32>(1).unwrap();
    let mut m0 = s.alloc_zeros::<u32>(0).unwrap();

    let e = activation::add_relu_mask_fwd(&ctx, &x, &z10, &mut y, Some(&mut m)).unwrap_err();
    assert_eq!(e.argument(), Some("z"), "{e}");
    assert!(e.to_string().contains("length 10, expected 12"), "{e}");
    let e = activation::relu_mask_fwd(&ctx, &x, &mut y10, Some(&mut m)).unwrap_err();
    assert_eq!(e.argument(), Some("y"), "{e}");
    let e = activation::relu_mask_fwd(&ctx, &x, &mut y, Some(&mut m0)).unwrap_err();
    assert_eq!(e.argument(), Some("mask"), "{e}");
    let e = activation::relu_mask_bwd(&ctx, &x, &m, &mut y10).unwrap_err();
    assert_eq!(e.argument(), Some("dx"), "{e}");
    let e = activation::relu_mask_bwd(&ctx, &x, &m0, &mut y).unwrap_err();
    assert_eq!(e.argument(), Some("mask"), "{e}");
    let mut dz = s.alloc_zeros::<f32>(11).unwrap();
    let e = activation::relu_mask_bwd_dual(&ctx, &x, &m, &mut y, &mut dz).unwrap_err();
    assert_eq!(e.argument(), Some("dz"), "{e}");
    let e =
        activation::add_relu_mask_fwd_inplace(&ctx, &mut y, &z10, None::<&mut NoMask>).unwrap_err();
    assert_eq!(e.argument(), Some("z"), "{e}");
    let e = activation::relu_mask_bwd_inplace(&ctx, &mut y, &m0).unwrap_err();
    assert_eq!(e.argument(), Some("mask"), "{e}");
    let e = baseline::relu_bwd_from_y(&ctx, &x, &z10, &mut y).unwrap_err();
    assert_eq!(e.argument(), Some("y"), "{e}");

    // Partial overlap: y is x shifted by two elements.
    let big = s.clone_htod(&rng.vec::<f32>(64, -1.0, 1.0)).unwrap();
    let mut y_shifted = alias::<f32, f32>(&ctx, &big, 8, 32);
    let mut m2 = s.alloc_zeros::<u32>(1).unwrap();
    let e = activation::relu_mask_fwd(&ctx, &big.slice(0..32), &mut y_shifted, Some(&mut m2))
        .unwrap_err();
    assert_eq!(e.argument(), Some("y"), "{e}");
    assert!(e.to_string().contains("overlaps `x`"), "{e}");
    // The mask inside the data.
    let mut y_other = s.alloc_zeros::<f32>(32).unwrap();
    let mut mask_in_x = alias::<f32, u32>(&ctx, &big, 16, 1);
    let e = activation::relu_mask_fwd(&ctx, &big.slice(0..32), &mut y_other, Some(&mut mask_in_x))
        .unwrap_err();
    assert_eq!(e.argument(), Some("mask"), "{e}");
    // dx and dz the same memory.
    let dy = s.alloc_zeros::<f32>(32).unwrap();
    let mut dx = s.alloc_zeros::<f32>(32).unwrap();
    let mut dz_same = alias::<f32, f32>(&ctx, &dx, 0, 32);
    let e = activation::relu_mask_bwd_dual(&ctx, &dy, &m2, &mut dx, &mut dz_same).unwrap_err();
    assert_eq!(e.argument(), Some("dz"), "{e}");
    ctx.synchronize().unwrap();
    y_shifted.leak();
    mask_in_x.leak();
    dz_same.leak();
}
