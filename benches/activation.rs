//! Bitmask ReLU / Add+ReLU kernels against the device copy bandwidth and against the two schemes
//! they replace (the y-based backward and the naive "one thread, eight elements, one byte of
//! mask" forward).
//!
//! For every case (ResNet-50 activation shapes, plus one large f32 and f16 tensor) each kernel is
//! timed with CUDA events (median), rotating among enough buffer sets that the data one
//! iteration touches has left the L2 by the time the same set comes round again. Bytes counted
//! are the minimal bytes read + written (data and mask); the floor is those bytes at the
//! measured device-to-device copy bandwidth. Prints a markdown table, then one JSON object per
//! line (`{"bench":"activation",...}`).
//!
//! Run on a GPU: `cargo bench --bench activation` (or `.gpu/run --bench-only`). Arguments are
//! ignored. Meant to finish well within a minute on an H100 (most of it host-side data
//! generation and uploads).

#[path = "support/exit.rs"]
mod exit;

use anyhow::{Context as _, Result};
use cudarc::driver::{CudaSlice, DevicePtr};
use half::f16;
use nnfuse::activation::{self, baseline, mask_words, NoMask};
use nnfuse::internals::activation::choose_path;
use nnfuse::internals::timing::{copy_bandwidth, time_gpu, Timing, TimingOptions};
use nnfuse::{Context, DType, Element};

/// One set of buffers for one case; the bench rotates among several.
struct Set<T> {
    x: CudaSlice<T>,
    z: CudaSlice<T>,
    y: CudaSlice<T>,
    dy: CudaSlice<T>,
    dx: CudaSlice<T>,
    dz: CudaSlice<T>,
    mask: CudaSlice<u32>,
}

/// One measured kernel.
struct Row {
    shape: Vec<usize>,
    dtype: DType,
    kernel: &'static str,
    path: &'static str,
    n: usize,
    bytes: f64,
    t: Timing,
}

impl Row {
    fn gbps(&self) -> f64 {
        self.bytes / (self.t.median_ms * 1e-3) / 1e9
    }
    fn floor_us(&self, copy_bw: f64) -> f64 {
        self.bytes / copy_bw * 1e6
    }
    fn pct_copy(&self, copy_bw: f64) -> f64 {
        100.0 * self.floor_us(copy_bw) / self.t.median_us()
    }
}

fn shape_str(s: &[usize]) -> String {
    s.iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join("x")
}

/// Uniform in [-1, 1): half the elements positive, as after a BatchNorm.
fn host_data<T: Element>(n: usize, mut seed: u64) -> Vec<T> {
    (0..n)
        .map(|_| {
            // xorshift64*: fast enough for 10^8 elements.
            seed ^= seed >> 12;
            seed ^= seed << 25;
            seed ^= seed >> 27;
            let r = seed.wrapping_mul(0x2545_F491_4F6C_DD1D);
            T::from_f64((r >> 11) as f64 / (1u64 << 52) as f64 - 1.0)
        })
        .collect()
}

fn opts() -> TimingOptions {
    TimingOptions {
        warmup: 3,
        max_iters: 100,
        min_iters: 10,
        budget_ms: 120.0,
    }
}

fn bench_case<T: Element>(ctx: &Context, shape: &[usize], rows: &mut Vec<Row>) -> Result<()> {
    let n: usize = shape.iter().product();
    let es = T::DTYPE.size();
    let tensor = n * es;
    let mb = 4 * mask_words(n);
    // The smallest kernel (ReLU forward) touches two tensors and a mask per set. Rotate among
    // enough sets that the other sets touched before a set comes round again add up to at least
    // twice the L2 (so none of its data can still be cached).
    let l2 = ctx.info().l2_bytes.max(1) as usize;
    let copies = (2 * l2).div_ceil(2 * tensor + mb) + 1;
    let s = ctx.stream();
    let host = host_data::<T>(n, 0x9E37_79B9_7F4A_7C15 ^ n as u64);
    let host2 = host_data::<T>(n, 0xD1B5_4A32_D192_ED03 ^ n as u64);
    let mut sets = Vec::with_capacity(copies);
    for _ in 0..copies {
        sets.push(Set {
            x: s.clone_htod(&host).context("upload x")?,
            z: s.clone_htod(&host2).context("upload z")?,
            y: s.alloc_zeros::<T>(n).context("alloc y")?,
            dy: s.clone_htod(&host2).context("upload dy")?,
            dx: s.alloc_zeros::<T>(n).context("alloc dx")?,
            dz: s.alloc_zeros::<T>(n).context("alloc dz")?,
            mask: s.alloc_zeros::<u32>(mask_words(n)).context("alloc mask")?,
        });
    }
    drop((host, host2));
    // The path every launch on whole buffers takes (fresh allocations are 256-byte aligned, so
    // this is the vector path; computed rather than assumed).
    let whole = {
        let b = &sets[0];
        let (xp, _a) = b.x.device_ptr(s);
        let (yp, _b) = b.y.device_ptr(s);
        let (zp, _c) = b.z.device_ptr(s);
        let (gp, _d) = b.dy.device_ptr(s);
        let (dxp, _e) = b.dx.device_ptr(s);
        let (dzp, _f) = b.dz.device_ptr(s);
        choose_path(&[xp, yp, zp, gp, dxp, dzp]).name()
    };
    let c = copies;
    let mut push = |kernel, path, bytes: usize, t: Timing| {
        rows.push(Row {
            shape: shape.to_vec(),
            dtype: T::DTYPE,
            kernel,
            path,
            n,
            bytes: bytes as f64,
            t,
        })
    };

    // Forwards first: they leave y = relu(x) and its mask in every set for the backwards.
    let t = time_gpu(ctx, opts(), |i| {
        let b = &mut sets[i % c];
        activation::relu_mask_fwd(ctx, &b.x, &mut b.y, Some(&mut b.mask))
    })?;
    push("relu fwd", whole, 2 * tensor + mb, t);
    let t = time_gpu(ctx, opts(), |i| {
        let b = &mut sets[i % c];
        baseline::relu_mask_fwd_naive8(ctx, &b.x, &mut b.y, &mut b.mask)
    })?;
    push("naive8 fwd (baseline)", "scalar", 2 * tensor + mb, t);
    let t = time_gpu(ctx, opts(), |i| {
        let b = &mut sets[i % c];
        activation::relu_mask_fwd(ctx, &b.x, &mut b.y, None::<&mut NoMask>)
    })?;
    push("relu fwd, no mask", whole, 2 * tensor, t);
    let t = time_gpu(ctx, opts(), |i| {
        let b = &mut sets[i % c];
        activation::add_relu_mask_fwd(ctx, &b.x, &b.z, &mut b.dx, Some(&mut b.mask))
    })?;
    push("add-relu fwd", whole, 3 * tensor + mb, t);
    // Restore y and the mask of relu(x) (the add-relu forward overwrote the mask).
    for b in sets.iter_mut() {
        activation::relu_mask_fwd(ctx, &b.x, &mut b.y, Some(&mut b.mask))?;
    }
    let t = time_gpu(ctx, opts(), |i| {
        let b = &mut sets[i % c];
        activation::relu_mask_bwd(ctx, &b.dy, &b.mask, &mut b.dx)
    })?;
    push("mask bwd", whole, 2 * tensor + mb, t);
    let t = time_gpu(ctx, opts(), |i| {
        let b = &mut sets[i % c];
        activation::relu_mask_bwd_dual(ctx, &b.dy, &b.mask, &mut b.dx, &mut b.dz)
    })?;
    push("mask bwd dual", whole, 3 * tensor + mb, t);
    let t = time_gpu(ctx, opts(), |i| {
        let b = &mut sets[i % c];
        baseline::relu_bwd_from_y(ctx, &b.dy, &b.y, &mut b.dx)
    })?;
    push("y bwd (baseline)", whole, 3 * tensor, t);

    // The scalar path (a view starting one element in), on the large tensors only.
    if tensor >= 64 << 20 {
        let m = n - 1;
        let mbm = 4 * mask_words(m);
        let t = time_gpu(ctx, opts(), |i| {
            let b = &mut sets[i % c];
            activation::relu_mask_fwd(
                ctx,
                &b.x.slice(1..),
                &mut b.y.slice_mut(1..),
                Some(&mut b.mask),
            )
        })?;
        push("relu fwd, view at +1", "scalar", 2 * m * es + mbm, t);
        let t = time_gpu(ctx, opts(), |i| {
            let b = &mut sets[i % c];
            activation::relu_mask_bwd(ctx, &b.dy.slice(1..), &b.mask, &mut b.dx.slice_mut(1..))
        })?;
        push("mask bwd, view at +1", "scalar", 2 * m * es + mbm, t);
    }
    ctx.synchronize()?;
    eprintln!(
        "  {} {}: {} buffer set(s) of {:.1} MB",
        shape_str(shape),
        T::DTYPE,
        copies,
        (6 * tensor + mb) as f64 / 1e6
    );
    Ok(())
}

/// Median time of `kernel` in the case of `r`.
fn find<'a>(rows: &'a [Row], r: &Row, kernel: &str) -> Option<&'a Row> {
    rows.iter()
        .find(|o| o.shape == r.shape && o.dtype == r.dtype && o.kernel == kernel)
}

fn main() -> std::process::ExitCode {
    exit::finish("activation", run())
}

fn run() -> Result<()> {
    let ctx = Context::new(0).context("the activation benchmark needs a CUDA GPU")?;
    eprintln!("{}", ctx.info());
    let copy_bw = copy_bandwidth(&ctx, 1 << 30)?;
    eprintln!(
        "device copy bandwidth (read + write, 1 GiB): {:.0} GB/s",
        copy_bw / 1e9
    );

    let resnet: [&[usize]; 5] = [
        &[16, 32, 112, 112],
        &[64, 64, 112, 112],
        &[64, 256, 56, 56],
        &[64, 512, 28, 28],
        &[64, 1024, 14, 14],
    ];
    let mut rows = Vec::new();
    let started = std::time::Instant::now();
    bench_case::<f32>(&ctx, &[16, 32, 112, 112], &mut rows)?;
    for s in resnet {
        bench_case::<f16>(&ctx, s, &mut rows)?;
    }
    // Large: 205 MB per tensor in both types.
    bench_case::<f32>(&ctx, &[64, 64, 112, 112], &mut rows)?;
    bench_case::<f16>(&ctx, &[64, 128, 112, 112], &mut rows)?;
    eprintln!("measured in {:.1} s", started.elapsed().as_secs_f64());

    println!();
    println!(
        "Bitmask activations on {} — copy bandwidth {:.0} GB/s (read + write). Bytes = minimal \
         bytes read + written; floor = bytes / copy bandwidth.",
        ctx.info().name,
        copy_bw / 1e9
    );
    println!();
    println!("| shape | dtype | kernel | path | median µs | GB/s | floor µs | % of copy | ratio |");
    println!("|---|---|---|---|---:|---:|---:|---:|---|");
    for r in &rows {
        let ratio = match r.kernel {
            "mask bwd" => find(&rows, r, "y bwd (baseline)").map(|y| {
                format!(
                    "mask-bwd : y-bwd = {:.2}x faster",
                    y.t.median_ms / r.t.median_ms
                )
            }),
            "relu fwd" => find(&rows, r, "naive8 fwd (baseline)").map(|b| {
                format!(
                    "warp-vote : naive8 = {:.2}x faster",
                    b.t.median_ms / r.t.median_ms
                )
            }),
            _ => None,
        };
        println!(
            "| {} | {} | {} | {} | {:.1} | {:.0} | {:.1} | {:.0}% | {} |",
            shape_str(&r.shape),
            r.dtype,
            r.kernel,
            r.path,
            r.t.median_us(),
            r.gbps(),
            r.floor_us(copy_bw),
            r.pct_copy(copy_bw),
            ratio.unwrap_or_default()
        );
    }
    println!();
    println!(
        "{}",
        serde_json::json!({
            "bench": "activation",
            "device": ctx.info().name,
            "copy_bandwidth_gbps": copy_bw / 1e9,
        })
    );
    for r in &rows {
        println!(
            "{}",
            serde_json::json!({
                "bench": "activation",
                "shape": r.shape,
                "dtype": r.dtype.name(),
                "kernel": r.kernel,
                "path": r.path,
                "n": r.n,
                "bytes": r.bytes,
                "median_us": r.t.median_us(),
                "p10_us": r.t.p10_ms * 1e3,
                "p90_us": r.t.p90_ms * 1e3,
                "iters": r.t.iters,
                "gbps": r.gbps(),
                "floor_us": r.floor_us(copy_bw),
                "pct_copy": r.pct_copy(copy_bw),
            })
        );
        let ratio = match r.kernel {
            "mask bwd" => find(&rows, r, "y bwd (baseline)")
                .map(|y| ("mask_bwd_vs_y_bwd", y.t.median_ms / r.t.median_ms)),
            "relu fwd" => find(&rows, r, "naive8 fwd (baseline)")
                .map(|b| ("warp_vote_vs_naive8", b.t.median_ms / r.t.median_ms)),
            _ => None,
        };
        if let Some((name, speedup)) = ratio {
            println!(
                "{}",
                serde_json::json!({
                    "bench": "activation",
                    "shape": r.shape,
                    "dtype": r.dtype.name(),
                    "ratio": name,
                    "speedup": speedup,
                })
            );
        }
    }
    Ok(())
}
