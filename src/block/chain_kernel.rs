//! Launchers of the conv chain's two kernels in `kernels/block_stats.cu`, the pieces around its
//! cuDNN graphs: `bn_finalize_affine_<t>`, the BatchNorm finalize from per-channel sums that
//! also writes the BatchNorm as a per-channel affine map in T (the next convolution's graph
//! applies `relu(z * eq_scale + eq_bias)` to its input), and `bn_apply_eq_<t>`, the backward's
//! `dz = a * dy + b * x + c` from the coefficients its graph outputs. Validation (all that can
//! be checked without touching memory), kernel choice and grid are pure and CPU-tested; what
//! each address holds is the caller's promise.

use cudarc::driver::{DeviceRepr, LaunchConfig};

use super::stats_kernel::launch_1d;
use crate::context::Context;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels;
use crate::launch;

/// Threads per block of `bn_apply_eq_<t>` (its `__launch_bounds__`).
const APPLY_THREADS: u32 = 256;
/// Most blocks per SM of `bn_apply_eq_<t>`: a full H100 SM (2048 threads), the rest of the
/// tensor by the grid-stride loop.
const APPLY_BLOCKS_PER_SM: u64 = 8;
/// Bytes of one vector step of `bn_apply_eq_<t>`.
const VECTOR_BYTES: u64 = 16;

/// `bn_finalize_affine_<t>`'s argument, laid out as `struct FinalizeAffineArgs` of the kernel
/// (checked by the tests below), so that it is passed as it is.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FinalizeAffine {
    /// Σz per channel (f32).
    pub sum: u64,
    /// Σz² per channel (f32).
    pub sqsum: u64,
    /// f32.
    pub gamma: u64,
    /// f32.
    pub beta: u64,
    /// The mean rounded to f32 (f32 out).
    pub saved_mean: u64,
    /// The mean's rounding error (f32 out; required: the kernel always writes it).
    pub saved_mean_lo: u64,
    /// `1 / sqrt(var + eps)`, biased variance (f32 out).
    pub saved_invstd: u64,
    /// f32, updated in place with `momentum`.
    pub running_mean: u64,
    /// f32, updated in place with `momentum` and the unbiased variance.
    pub running_var: u64,
    /// `gamma * inv_std` (T out).
    pub eq_scale: u64,
    /// `beta - mean * gamma * inv_std` (T out).
    pub eq_bias: u64,
    /// Values per channel, > 1.
    pub count: f64,
    pub channels: u32,
    pub eps: f32,
    pub momentum: f64,
}

// SAFETY: plain old data laid out as the kernel's struct (checked by the tests below).
unsafe impl DeviceRepr for FinalizeAffine {}

/// `dz = a * dy + b * x + c` per channel over channels-last data.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ApplyEq {
    /// T, `len` elements.
    pub dy: u64,
    /// T, `len` elements.
    pub x: u64,
    /// f32 per channel.
    pub a: u64,
    /// f32 per channel.
    pub b: u64,
    /// f32 per channel.
    pub c: u64,
    /// T out, `len` elements, distinct from the rest.
    pub dz: u64,
    /// Elements, a multiple of `channels`.
    pub len: u64,
    pub channels: u32,
}

/// `bn_apply_eq_<t>`'s argument (`struct ApplyEqArgs` of the kernel): [`ApplyEq`] and the path.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ApplyEqArgs {
    dy: u64,
    x: u64,
    a: u64,
    b: u64,
    c: u64,
    dz: u64,
    len: u64,
    channels: u32,
    vec: u32,
}

// SAFETY: plain old data laid out as the kernel's struct (checked by the tests below).
unsafe impl DeviceRepr for ApplyEqArgs {}

fn finalize_kernel(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "bn_finalize_affine_f32",
        DType::F16 => "bn_finalize_affine_f16",
        DType::BF16 => "bn_finalize_affine_bf16",
    }
}

fn apply_kernel(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "bn_apply_eq_f32",
        DType::F16 => "bn_apply_eq_f16",
        DType::BF16 => "bn_apply_eq_bf16",
    }
}

/// Elements of `dtype` in one 16-byte vector.
fn vector_width(dtype: DType) -> u64 {
    VECTOR_BYTES / dtype.size() as u64
}

/// Whether `bn_apply_eq_<t>` takes 16-byte vectors: every data pointer 16-byte aligned and the
/// channels a multiple of the vector, so that a vector never straddles a row (pure).
fn use_vector(dtype: DType, channels: u64, data: [u64; 3]) -> bool {
    channels % vector_width(dtype) == 0 && data.iter().all(|p| p % VECTOR_BYTES == 0)
}

/// Blocks of `bn_apply_eq_<t>` for `steps` steps (vectors or elements) of which `cycle` make
/// one row of channels, on `sms` SMs (pure). Enough for one step a thread, capped at
/// [`APPLY_BLOCKS_PER_SM`] per SM; a capped grid is rounded down to a multiple of the blocks
/// whose threads make whole rows where one fits under the cap (which keeps at least half of
/// it), so that every thread keeps its channels and loads their values once.
fn apply_blocks(steps: u64, cycle: u64, sms: u64) -> u32 {
    let threads = u64::from(APPLY_THREADS);
    let needed = steps.div_ceil(threads).max(1);
    let cap = (sms.max(1) * APPLY_BLOCKS_PER_SM).min(u64::from(u32::MAX));
    if needed <= cap {
        return needed as u32;
    }
    let cycle = cycle.max(1);
    let whole = cycle / gcd(cycle, threads);
    let blocks = if whole <= cap {
        cap / whole * whole
    } else {
        cap
    };
    blocks as u32
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The bytes of `count` values of `size` bytes from `addr`, as a half-open range, or an error
/// naming `name` (null, misaligned, or past the address space).
fn span(name: &str, addr: u64, count: u64, size: u64) -> Result<(u64, u64)> {
    if addr == 0 {
        return Err(Error::invalid(name, "is a null device address"));
    }
    if addr % size != 0 {
        return Err(Error::invalid(
            name,
            format!("{addr:#x} is not aligned to its {size}-byte elements"),
        ));
    }
    count
        .checked_mul(size)
        .and_then(|bytes| addr.checked_add(bytes))
        .map(|end| (addr, end))
        .ok_or_else(|| {
            Error::invalid(
                name,
                format!(
                    "{count} elements of {size} bytes from {addr:#x} overflow the address space"
                ),
            )
        })
}

/// Every output range disjoint from every other output and from every input; the error names
/// the output (pure).
fn check_disjoint(outputs: &[(&str, (u64, u64))], inputs: &[(&str, (u64, u64))]) -> Result<()> {
    let overlaps = |a: (u64, u64), b: (u64, u64)| a.0 < b.1 && b.0 < a.1;
    for (i, &(name, r)) in outputs.iter().enumerate() {
        let others = outputs[i + 1..].iter().chain(inputs);
        if let Some((other, _)) = others.into_iter().find(|(_, o)| overlaps(r, *o)) {
            return Err(Error::invalid(name, format!("overlaps {other}")));
        }
    }
    Ok(())
}

/// What [`finalize_affine`] can check without touching memory (pure).
fn check_finalize(dtype: DType, a: &FinalizeAffine) -> Result<()> {
    if a.channels == 0 {
        return Err(Error::invalid("channels", "must be > 0"));
    }
    if !(a.count.is_finite() && a.count > 1.0) {
        return Err(Error::invalid(
            "count",
            format!(
                "{} must be finite and > 1 (the unbiased variance divides by count - 1)",
                a.count
            ),
        ));
    }
    if !(a.eps.is_finite() && a.eps > 0.0) {
        return Err(Error::invalid(
            "eps",
            format!("{} must be finite and > 0", a.eps),
        ));
    }
    if !(a.momentum.is_finite() && (0.0..=1.0).contains(&a.momentum)) {
        return Err(Error::invalid(
            "momentum",
            format!("{} must lie in [0, 1]", a.momentum),
        ));
    }
    let c = u64::from(a.channels);
    let (f, t) = (4, dtype.size() as u64);
    let inputs = [
        ("sum", span("sum", a.sum, c, f)?),
        ("sqsum", span("sqsum", a.sqsum, c, f)?),
        ("gamma", span("gamma", a.gamma, c, f)?),
        ("beta", span("beta", a.beta, c, f)?),
    ];
    let outputs = [
        ("saved_mean", span("saved_mean", a.saved_mean, c, f)?),
        (
            "saved_mean_lo",
            span("saved_mean_lo", a.saved_mean_lo, c, f)?,
        ),
        ("saved_invstd", span("saved_invstd", a.saved_invstd, c, f)?),
        ("running_mean", span("running_mean", a.running_mean, c, f)?),
        ("running_var", span("running_var", a.running_var, c, f)?),
        ("eq_scale", span("eq_scale", a.eq_scale, c, t)?),
        ("eq_bias", span("eq_bias", a.eq_bias, c, t)?),
    ];
    check_disjoint(&outputs, &inputs)
}

/// What [`apply_eq`] can check without touching memory (pure).
fn check_apply(dtype: DType, a: &ApplyEq) -> Result<()> {
    if a.channels == 0 {
        return Err(Error::invalid("channels", "must be > 0"));
    }
    if a.len % u64::from(a.channels) != 0 {
        return Err(Error::invalid(
            "len",
            format!("{} is not a multiple of the {} channels", a.len, a.channels),
        ));
    }
    let (c, n, t) = (u64::from(a.channels), a.len, dtype.size() as u64);
    let inputs = [
        ("dy", span("dy", a.dy, n, t)?),
        ("x", span("x", a.x, n, t)?),
        ("a", span("a", a.a, c, 4)?),
        ("b", span("b", a.b, c, 4)?),
        ("c", span("c", a.c, c, 4)?),
    ];
    check_disjoint(&[("dz", span("dz", a.dz, n, t)?)], &inputs)
}

/// The BatchNorm finalize from per-channel sums (`bn_finalize_from_sums`' arithmetic and
/// outputs: f64, saved mean hi + lo, saved inverse std, running statistics with the unbiased
/// variance) plus `eq_scale = gamma * inv_std` and `eq_bias = beta - mean * eq_scale` in
/// `dtype` (f64, rounded once), so that `relu(z * eq_scale + eq_bias)` is the BatchNorm+ReLU of
/// z. One thread per channel.
///
/// # Safety
/// Every address is a device address of the Context's device holding `a.channels` values of
/// its type (f32; `eq_scale` and `eq_bias` of `dtype`), outputs distinct from inputs, valid
/// until the queued work completes; `a.count > 1`.
pub(crate) unsafe fn finalize_affine(
    ctx: &Context,
    dtype: DType,
    a: &FinalizeAffine,
) -> Result<()> {
    check_finalize(dtype, a)?;
    let name = finalize_kernel(dtype);
    let f = ctx.function(&kernels::BLOCK_STATS, name)?;
    // SAFETY: FinalizeAffine is the kernel's struct; the addresses as the caller's contract
    // says, checked above for null, alignment and overlap.
    unsafe {
        launch::launch_kernel(
            ctx,
            &f,
            launch_1d(u64::from(a.channels)),
            &mut [launch::arg(a)],
            "cuLaunchKernel(bn_finalize_affine)",
        )
    }
}

/// `dz[i] = a[ch] * dy[i] + b[ch] * x[i] + c[ch]` with `ch = i % channels` (channels-last), in
/// f32 as `fmaf(a, dy, fmaf(b, x, c))`, rounded once to `dtype`: 16-byte vectors where dy, x
/// and dz are 16-byte aligned and the channels a multiple of the vector, one element a step
/// otherwise.
///
/// # Safety
/// `dy`, `x`, `dz` hold `a.len` elements of `dtype`, `a`, `b`, `c` `a.channels` f32s, all on
/// the Context's device, `dz` distinct from the rest, valid until the queued work completes.
pub(crate) unsafe fn apply_eq(ctx: &Context, dtype: DType, a: &ApplyEq) -> Result<()> {
    check_apply(dtype, a)?;
    if a.len == 0 {
        return Ok(());
    }
    let channels = u64::from(a.channels);
    let vec = use_vector(dtype, channels, [a.dy, a.x, a.dz]);
    let width = if vec { vector_width(dtype) } else { 1 };
    let blocks = apply_blocks(
        a.len / width,
        channels / width,
        launch::sm_count(ctx).into(),
    );
    let args = ApplyEqArgs {
        dy: a.dy,
        x: a.x,
        a: a.a,
        b: a.b,
        c: a.c,
        dz: a.dz,
        len: a.len,
        channels: a.channels,
        vec: u32::from(vec),
    };
    let name = apply_kernel(dtype);
    let f = ctx.function(&kernels::BLOCK_STATS, name)?;
    tracing::debug!(
        kernel = name,
        vec,
        blocks,
        len = a.len,
        "BatchNorm backward apply"
    );
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (APPLY_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: ApplyEqArgs is the kernel's struct; the addresses as the caller's contract says,
    // checked above for null, alignment, length and overlap; `vec` only where use_vector found
    // the data aligned and the rows whole vectors.
    unsafe {
        launch::launch_kernel(
            ctx,
            &f,
            cfg,
            &mut [launch::arg(&args)],
            "cuLaunchKernel(bn_apply_eq)",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(type, field)` in order of `struct name { ... };` in the CUDA source.
    fn cuda_fields(src: &str, name: &str) -> Vec<(String, String)> {
        let start = src
            .find(&format!("struct {name} {{"))
            .expect("struct in source");
        let body = &src[start..];
        let body = &body[body.find('{').unwrap() + 1..body.find("};").unwrap()];
        body.lines()
            .map(|l| l.split("//").next().unwrap().trim())
            .filter(|l| !l.is_empty())
            .map(|l| {
                let l = l.trim_end_matches(';');
                let field = l.rsplit([' ', '*']).next().unwrap();
                let ty = l[..l.len() - field.len()].trim().to_string();
                (ty, field.to_string())
            })
            .collect()
    }

    /// The C layout of the parsed fields: (field, offset), and the struct's size.
    fn c_layout(fields: &[(String, String)]) -> (Vec<(String, usize)>, usize) {
        let (mut off, mut align, mut out) = (0usize, 1usize, Vec::new());
        for (ty, field) in fields {
            let size = match ty.as_str() {
                t if t.ends_with('*') => 8,
                "double" | "u64" => 8,
                "float" | "u32" => 4,
                t => panic!("unknown CUDA type {t}"),
            };
            off = off.next_multiple_of(size);
            align = align.max(size);
            out.push((field.clone(), off));
            off += size;
        }
        (out, off.next_multiple_of(align))
    }

    macro_rules! offsets {
        ($t:ty; $($f:ident),*) => {
            vec![$((stringify!($f).to_string(), std::mem::offset_of!($t, $f))),*]
        };
    }

    #[test]
    fn argument_structs_match_the_kernels() {
        let src = kernels::BLOCK_STATS.source;
        let (cuda, size) = c_layout(&cuda_fields(src, "FinalizeAffineArgs"));
        let rust = offsets!(FinalizeAffine; sum, sqsum, gamma, beta, saved_mean, saved_mean_lo,
            saved_invstd, running_mean, running_var, eq_scale, eq_bias, count, channels, eps,
            momentum);
        assert_eq!(rust, cuda);
        assert_eq!(std::mem::size_of::<FinalizeAffine>(), size);
        assert_eq!(size, 112);
        let (cuda, size) = c_layout(&cuda_fields(src, "ApplyEqArgs"));
        let rust = offsets!(ApplyEqArgs; dy, x, a, b, c, dz, len, channels, vec);
        assert_eq!(rust, cuda);
        assert_eq!(std::mem::size_of::<ApplyEqArgs>(), size);
        assert_eq!(size, 64);
    }

    #[test]
    fn every_kernel_name_is_in_the_source() {
        let src = kernels::BLOCK_STATS.source;
        for d in DType::ALL {
            for name in [finalize_kernel(d), apply_kernel(d)] {
                assert!(name.ends_with(d.name()), "{name}");
                let (decl, args) = if name.starts_with("bn_apply") {
                    ("void __launch_bounds__(256) ", "ApplyEqArgs a")
                } else {
                    ("void ", "FinalizeAffineArgs a")
                };
                let sig = format!("extern \"C\" __global__ {decl}{name}({args})");
                assert!(src.contains(&sig), "{sig}");
            }
        }
        assert!(src.contains(&format!("__launch_bounds__({APPLY_THREADS})")));
    }

    #[test]
    fn the_vector_path_needs_aligned_data_and_whole_vectors_per_row() {
        let ok = [0x1000u64, 0x2000, 0x3000];
        for (d, w) in [(DType::F32, 4), (DType::F16, 8), (DType::BF16, 8)] {
            assert_eq!(vector_width(d), w);
            for c in [w, 2 * w, 64, 256, 1000 * w] {
                assert!(use_vector(d, c, ok), "{d} C={c}");
                for k in 0..3 {
                    for off in [2u64, 4, 8] {
                        let mut p = ok;
                        p[k] += off;
                        assert!(!use_vector(d, c, p), "{d} C={c} pointer {k} + {off}");
                    }
                }
            }
            for c in [1, 3, w / 2, w + 2, 3 * w - 2] {
                assert!(!use_vector(d, c, ok), "{d} C={c}");
            }
        }
    }

    /// Runs the kernel's index and channel arithmetic for every thread of the grid: every step
    /// is visited once, each with the channel `(v * width) % C`; a grid that fills its cap keeps
    /// every thread on its channels where it can.
    #[test]
    fn the_grid_covers_every_element_once_with_the_right_channel() {
        let t = u64::from(APPLY_THREADS);
        for (len, c, width, sms) in [
            (64u64, 64u64, 8u64, 132u64),
            (3 * 7 * 5, 3, 1, 1),
            (24 * 1000, 24, 8, 1),
            (1000 * 120, 120, 8, 1),
            (2000 * 120, 120, 1, 2),
            (1000 * 1000, 1000, 4, 2),
            (97 * 13 * 1000, 97 * 13, 1, 1),
            (2 * 300_007, 300_007, 1, 3),
            (8 * 56 * 56 * 64, 64, 8, 4),
        ] {
            let steps = len / width;
            let cycle = c / width;
            let blocks = u64::from(apply_blocks(steps, cycle, sms));
            assert!(
                blocks >= 1 && blocks <= sms * APPLY_BLOCKS_PER_SM,
                "{blocks}"
            );
            let stride = blocks * t;
            if steps > sms * APPLY_BLOCKS_PER_SM * t {
                assert!(
                    2 * blocks >= sms * APPLY_BLOCKS_PER_SM,
                    "half the cap at least"
                );
                let whole = cycle / gcd(cycle, t);
                if whole <= sms * APPLY_BLOCKS_PER_SM {
                    assert_eq!((stride * width) % c, 0, "len={len} C={c}: fixed channels");
                }
            }
            let mut seen = vec![0u8; steps as usize];
            for thread in 0..stride {
                let mut v = thread;
                let mut ch = (v * width) % c;
                let step = (stride * width) % c;
                while v < steps {
                    assert_eq!(ch, (v * width) % c, "len={len} C={c} v={v}");
                    seen[v as usize] += 1;
                    v += stride;
                    ch += step;
                    if ch >= c {
                        ch -= c;
                    }
                }
            }
            assert!(seen.iter().all(|&s| s == 1), "len={len} C={c}");
        }
        // Small tensors: one step per thread.
        assert_eq!(apply_blocks(1, 1, 132), 1);
        assert_eq!(apply_blocks(0, 1, 132), 1);
        assert_eq!(apply_blocks(257, 8, 132), 2);
        // The 51 MB class (f16, 56x56x256, batch 32) on an H100: a full cap, fixed channels.
        let b = apply_blocks(32 * 56 * 56 * 256 / 8, 256 / 8, 132);
        assert_eq!(u64::from(b), 132 * APPLY_BLOCKS_PER_SM);
    }

    fn finalize_ok() -> FinalizeAffine {
        FinalizeAffine {
            sum: 0x1000,
            sqsum: 0x2000,
            gamma: 0x3000,
            beta: 0x4000,
            saved_mean: 0x5000,
            saved_mean_lo: 0x6000,
            saved_invstd: 0x7000,
            running_mean: 0x8000,
            running_var: 0x9000,
            eq_scale: 0xa000,
            eq_bias: 0xb000,
            count: 392.0,
            channels: 64,
            eps: 1e-5,
            momentum: 0.1,
        }
    }

    fn arg_of(r: Result<()>) -> String {
        r.unwrap_err().argument().unwrap().to_string()
    }

    #[test]
    fn finalize_arguments_are_checked_and_named() {
        for d in DType::ALL {
            check_finalize(d, &finalize_ok()).unwrap();
        }
        type Edit = fn(&mut FinalizeAffine);
        let cases: [(&str, Edit); 11] = [
            ("channels", |a| a.channels = 0),
            ("count", |a| a.count = 1.0),
            ("count", |a| a.count = f64::NAN),
            ("eps", |a| a.eps = 0.0),
            ("momentum", |a| a.momentum = 1.5),
            ("gamma", |a| a.gamma = 0),
            ("saved_mean_lo", |a| a.saved_mean_lo = 0),
            ("eq_bias", |a| a.eq_bias = 0xb001),
            // 64 f32 (256 bytes) from 0x5000 reach 0x5100: saved_invstd inside them.
            ("saved_mean", |a| a.saved_invstd = 0x5080),
            ("running_var", |a| a.running_var = a.sum),
            ("sum", |a| a.sum = u64::MAX - 3),
        ];
        for (name, f) in cases {
            let mut a = finalize_ok();
            f(&mut a);
            assert_eq!(arg_of(check_finalize(DType::F16, &a)), name, "{a:?}");
        }
        // In-place running statistics are one buffer each, not an overlap.
        let mut a = finalize_ok();
        a.gamma = a.beta;
        check_finalize(DType::F32, &a).unwrap();
    }

    #[test]
    fn apply_arguments_are_checked_and_named() {
        let ok = ApplyEq {
            dy: 0x10_0000,
            x: 0x20_0000,
            a: 0x1000,
            b: 0x2000,
            c: 0x3000,
            dz: 0x30_0000,
            len: 64 * 100,
            channels: 64,
        };
        for d in DType::ALL {
            check_apply(d, &ok).unwrap();
        }
        // The per-channel values may be one buffer; 0 elements are fine.
        check_apply(
            DType::F16,
            &ApplyEq {
                b: ok.a,
                c: ok.a,
                len: 0,
                ..ok
            },
        )
        .unwrap();
        let cases: [(&str, ApplyEq); 7] = [
            ("channels", ApplyEq { channels: 0, ..ok }),
            (
                "len",
                ApplyEq {
                    len: 64 * 100 + 8,
                    ..ok
                },
            ),
            ("dy", ApplyEq { dy: 0, ..ok }),
            ("x", ApplyEq { x: ok.x + 1, ..ok }),
            (
                "dz",
                ApplyEq {
                    dz: ok.dy + 64,
                    ..ok
                },
            ),
            ("dz", ApplyEq { dz: ok.b, ..ok }),
            (
                "dy",
                ApplyEq {
                    len: u64::MAX / 64 * 64,
                    ..ok
                },
            ),
        ];
        for (name, a) in cases {
            assert_eq!(arg_of(check_apply(DType::F16, &a)), name, "{a:?}");
        }
    }
}

/// On the GPU (the lead runs these): the finalize against the old finalize bit for bit and the
/// affine map against f64; the apply against the same fused f32 arithmetic on the CPU bit for
/// bit, on both paths, capped grids with and without fixed channels; its bandwidth.
#[cfg(test)]
mod gpu_tests {
    use super::*;
    use crate::testutil::{gpu, Rng};
    use crate::Element;
    use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
    use half::{bf16, f16};

    fn addr<T>(s: &CudaStream, b: &CudaSlice<T>) -> u64 {
        b.device_ptr(s).0
    }

    /// Significand bits of T after the point (its rounding's relative half-ulp is 2^-(p+1))
    /// and the exponent of its smallest subnormal (the absolute half-ulp below the normals).
    fn rounding(d: DType) -> (i32, i32) {
        match d {
            DType::F32 => (23, -149),
            DType::F16 => (10, -24),
            DType::BF16 => (7, -133),
        }
    }

    fn finalize_case<T: Element>(ctx: &Context, rng: &mut Rng) {
        let s = ctx.stream();
        let (c, m, eps, momentum) = (67usize, 392.0f64, 1e-5f32, 0.1f64);
        let mut sum = vec![0f32; c];
        let mut sqsum = vec![0f32; c];
        for ch in 0..c {
            let (mu, var) = (rng.uniform(-2.0, 2.0), rng.uniform(0.05, 3.0));
            sum[ch] = (mu * m) as f32;
            sqsum[ch] = ((var + mu * mu) * m) as f32;
        }
        let gamma: Vec<f32> = rng.vec(c, 0.5, 2.0);
        let beta: Vec<f32> = rng.vec(c, -1.0, 1.0);
        let rm0: Vec<f32> = rng.vec(c, -1.0, 1.0);
        let rv0: Vec<f32> = rng.vec(c, 0.5, 2.0);
        let up = |v: &[f32]| s.clone_htod(v).unwrap();
        let nan = vec![f32::NAN; c];
        let (sum_d, sq_d, g_d, b_d) = (up(&sum), up(&sqsum), up(&gamma), up(&beta));
        // [old, new] x [mean, lo, invstd, running mean, running var]
        let outs: Vec<Vec<CudaSlice<f32>>> = (0..2)
            .map(|_| vec![up(&nan), up(&nan), up(&nan), up(&rm0), up(&rv0)])
            .collect();
        let poison = vec![T::from_f64(f64::NAN); c];
        let scale_d = s.clone_htod(&poison).unwrap();
        let bias_d = s.clone_htod(&poison).unwrap();
        let o = |k: usize, j: usize| addr(s, &outs[k][j]);
        let old = crate::batchnorm::FromSumsArgs {
            sum: addr(s, &sum_d),
            sqsum: addr(s, &sq_d),
            sum_lo: 0,
            sqsum_lo: 0,
            saved_mean: o(0, 0),
            saved_mean_lo: o(0, 1),
            saved_invstd: o(0, 2),
            running_mean: o(0, 3),
            running_var: o(0, 4),
            count: m,
            channels: c as u32,
            eps,
            momentum,
        };
        let new = FinalizeAffine {
            sum: old.sum,
            sqsum: old.sqsum,
            gamma: addr(s, &g_d),
            beta: addr(s, &b_d),
            saved_mean: o(1, 0),
            saved_mean_lo: o(1, 1),
            saved_invstd: o(1, 2),
            running_mean: o(1, 3),
            running_var: o(1, 4),
            eq_scale: addr(s, &scale_d),
            eq_bias: addr(s, &bias_d),
            count: m,
            channels: c as u32,
            eps,
            momentum,
        };
        // SAFETY: every buffer above holds c values of its type.
        unsafe {
            crate::batchnorm::finalize_from_sums(ctx, &old).unwrap();
            finalize_affine(ctx, T::DTYPE, &new).unwrap();
        }
        let down = |b: &CudaSlice<f32>| -> Vec<u32> {
            s.clone_dtoh(b)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        for (j, (a, b)) in outs[0].iter().zip(&outs[1]).enumerate() {
            assert_eq!(down(a), down(b), "{} output {j}", T::DTYPE);
        }
        let got_s = s.clone_dtoh(&scale_d).unwrap();
        let got_b = s.clone_dtoh(&bias_d).unwrap();
        let (p, sub) = rounding(T::DTYPE);
        let (half_ulp, half_sub) = (2f64.powi(-p - 1), 2f64.powi(sub - 1));
        for ch in 0..c {
            let (sm, q) = (f64::from(sum[ch]), f64::from(sqsum[ch]));
            let mean = sm / m;
            let var = (q - sm * mean).max(0.0) / m;
            let inv = 1.0 / (var + f64::from(eps)).sqrt();
            let scale = f64::from(gamma[ch]) * inv;
            let shift = mean * scale;
            let bias = f64::from(beta[ch]) - shift;
            // One rounding of T, plus the f64 differences (FMA contraction) of the operands.
            let tol = |w: f64, size: f64| w.abs() * half_ulp * 1.000_001 + half_sub + 1e-12 * size;
            let (gs, gb) = (got_s[ch].to_f64(), got_b[ch].to_f64());
            assert!(
                (gs - scale).abs() <= tol(scale, scale.abs()),
                "{} ch {ch}: scale {gs} vs {scale}",
                T::DTYPE
            );
            let size = f64::from(beta[ch]).abs() + shift.abs();
            assert!(
                (gb - bias).abs() <= tol(bias, size),
                "{} ch {ch}: bias {gb} vs {bias}",
                T::DTYPE
            );
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn finalize_affine_is_the_old_finalize_plus_the_affine_map() {
        let ctx = gpu();
        let mut rng = Rng::fresh("finalize_affine");
        finalize_case::<f32>(&ctx, &mut rng);
        finalize_case::<f16>(&ctx, &mut rng);
        finalize_case::<bf16>(&ctx, &mut rng);
    }

    /// `rows x c` elements at `skew` elements past each buffer's (256-byte aligned) start.
    fn apply_case<T: Element>(ctx: &Context, rng: &mut Rng, rows: usize, c: usize, skew: usize) {
        let s = ctx.stream();
        let n = rows * c;
        let dy: Vec<T> = rng.vec(n + skew, -2.0, 2.0);
        let x: Vec<T> = rng.vec(n + skew, -3.0, 3.0);
        let pa: Vec<f32> = rng.vec(c, -2.0, 2.0);
        let pb: Vec<f32> = rng.vec(c, -2.0, 2.0);
        let pc: Vec<f32> = rng.vec(c, -1.0, 1.0);
        let (dy_d, x_d) = (s.clone_htod(&dy).unwrap(), s.clone_htod(&x).unwrap());
        let (a_d, b_d, c_d) = (
            s.clone_htod(&pa).unwrap(),
            s.clone_htod(&pb).unwrap(),
            s.clone_htod(&pc).unwrap(),
        );
        let dz_d = s
            .clone_htod(&vec![T::from_f64(f64::NAN); n + skew + 8])
            .unwrap();
        let off = (skew * T::DTYPE.size()) as u64;
        let args = ApplyEq {
            dy: addr(s, &dy_d) + off,
            x: addr(s, &x_d) + off,
            a: addr(s, &a_d),
            b: addr(s, &b_d),
            c: addr(s, &c_d),
            dz: addr(s, &dz_d) + off,
            len: n as u64,
            channels: c as u32,
        };
        let vec = use_vector(T::DTYPE, c as u64, [args.dy, args.x, args.dz]);
        assert_eq!(vec, skew == 0 && c as u64 % vector_width(T::DTYPE) == 0);
        // SAFETY: the buffers hold what args says.
        unsafe { apply_eq(ctx, T::DTYPE, &args) }.unwrap();
        let got = s.clone_dtoh(&dz_d).unwrap();
        let what = format!("{} rows {rows} C {c} skew {skew} vec {vec}", T::DTYPE);
        for i in 0..n {
            let ch = i % c;
            let (d, v) = (dy[skew + i].to_f64() as f32, x[skew + i].to_f64() as f32);
            let want = T::from_f64(f64::from(pa[ch].mul_add(d, pb[ch].mul_add(v, pc[ch]))));
            let g = got[skew + i];
            // f32 is exact (one fused multiply-add each, as fmaf); a half may differ by one
            // unit in the last place where the host's conversion of a tie differs from cvt.rn.
            let ulp = match T::DTYPE {
                DType::F32 => 0.0,
                DType::F16 => want.to_f64().abs() * 2f64.powi(-10),
                DType::BF16 => want.to_f64().abs() * 2f64.powi(-7),
            };
            assert!(
                (g.to_f64() - want.to_f64()).abs() <= ulp,
                "{what}: element {i}: {g:?} vs {want:?}"
            );
        }
        let untouched = got[..skew].iter().chain(&got[skew + n..]);
        assert!(
            untouched.into_iter().all(|v| v.to_f64().is_nan()),
            "{what}: wrote outside dz"
        );
    }

    fn apply_cases<T: Element>(ctx: &Context, rng: &mut Rng) {
        let w = vector_width(T::DTYPE) as usize;
        for (rows, c, skew) in [
            (100, 64, 0), // vector
            (100, 64, 1), // misaligned: scalar
            (100, 6, 0),  // rows of partial vectors: scalar
            (3, 8, 0),
            // Capped grids (more than 132 * 8 * 256 steps): a vector / scalar row that the
            // threads tile (fixed channels), and one they cannot (2053 is prime).
            (2_400_000 / (15 * w), 15 * w, 0),
            (160, 2053 * w, 0),
            (5000, 67, 0),
            (200, 2053, 0),
        ] {
            apply_case::<T>(ctx, rng, rows, c, skew);
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn apply_eq_is_the_fused_f32_expression_rounded_once() {
        let ctx = gpu();
        let mut rng = Rng::fresh("apply_eq");
        apply_cases::<f32>(&ctx, &mut rng);
        apply_cases::<f16>(&ctx, &mut rng);
        apply_cases::<bf16>(&ctx, &mut rng);
    }
}
