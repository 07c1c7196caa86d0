//! nnfuse's im2col and col2im kernels (`kernels/im2col.cu`) on ResNet-50's layers against the
//! device copy bandwidth measured in the same run.
//!
//! Layers at batch 32: 3x3 64@56², 128@28², 256@14², 512@7² (stride 1, pad 1), the 7x7/2 stem
//! (3@224², pad 3) and the 1x1/2 projection (256@56²); f16 NHWC and f32 NCHW. Each kernel runs
//! on the whole batch (its columns fit the default 256 MiB cap in every case, so this is what the
//! im2col path launches), rotating among enough buffer sets that each set has left the 50 MiB
//! L2 before it comes round again.
//!
//! Two timings per kernel, CUDA events, medians:
//! - **back-to-back** (the figure the target refers to): `nnfuse::internals::timing::time_interleaved`,
//!   each sample a burst of launches queued back to back (at least 0.2 ms of GPU time), as in a
//!   network's forward pass, rounds interleaved with a device copy of the same byte count
//!   (`cuMemcpyDtoD` of half the bytes: what a plain copy of this size achieves, launch and
//!   tail included);
//! - **single launch**: one launch between two events (the first measurements' method): on a
//!   short kernel it also counts the host's submission gap before the launch, a few µs (the
//!   16 MB layers take ~5 µs), so it understates small kernels.
//!
//! Bytes: im2col writes the columns and must read the input's 32-byte sectors that hold an element
//! some tap uses (each once: a strided layer reads whole sectors of which it uses part); col2im
//! reads the columns and writes the whole input gradient. Floor = bytes / copy bandwidth (read +
//! write, `nnfuse::internals::timing::copy_bandwidth`, 1 GiB); "% of copy" = floor / back-to-back time, the
//! figure the im2col target (≥ 80%) refers to; "% of same-size copy" = the same-size copy's time
//! / the kernel's. Prints a markdown table, then one JSON object per line
//! (`{"bench":"conv_kernels",...}`).
//!
//! Run on a GPU: `cargo bench --bench conv_kernels`. Arguments are ignored. About a minute on
//! an H100.

#[path = "support/exit.rs"]
mod exit;

use anyhow::{Context as _, Result};
use cudarc::driver::CudaSlice;
use half::f16;
use nnfuse::conv::ConvShape;
use nnfuse::internals::conv::im2col;
use nnfuse::internals::timing::{
    copy_bandwidth, time_gpu, time_interleaved, InterleavedOptions, Timing, TimingOptions,
};
use nnfuse::internals::util;
use nnfuse::{Context, DType, Element, TensorFormat};

/// One measured kernel.
struct Row {
    layer: &'static str,
    format: TensorFormat,
    dtype: DType,
    /// "im2col" or "col2im".
    op: &'static str,
    /// The kernel launched (`kernels/im2col.cu`).
    kernel: &'static str,
    bytes: f64,
    /// Back-to-back launches.
    t: Timing,
    /// One launch between two events.
    single: Timing,
    /// A device copy of the same bytes, back to back, interleaved with `t`'s rounds.
    copy: Timing,
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
    fn pct_same_copy(&self) -> f64 {
        100.0 * self.copy.median_ms / self.t.median_ms
    }
}

fn single_opts() -> TimingOptions {
    TimingOptions {
        warmup: 3,
        max_iters: 40,
        min_iters: 10,
        budget_ms: 100.0,
    }
}

const BURST_OPTS: InterleavedOptions = InterleavedOptions {
    warmup_rounds: 1,
    min_sample_ms: 0.2,
    max_burst: 64,
    min_rounds: 7,
    max_rounds: 25,
    budget_ms: 120.0,
};

/// Which input indices along one axis some tap of some output reads.
fn used(extent: usize, k: usize, stride: usize, pad: usize, dil: usize, out: usize) -> Vec<bool> {
    let mut hit = vec![false; extent];
    for o in 0..out {
        for t in 0..k {
            if let Some(i) = (o * stride + t * dil).checked_sub(pad) {
                if i < extent {
                    hit[i] = true;
                }
            }
        }
    }
    hit
}

/// Bytes of the input that im2col must bring from memory: the 32-byte sectors holding an element
/// some tap reads, each once (a strided layer reads whole sectors of which it uses part).
fn read_bytes(s: &ConvShape, es: usize) -> Result<usize> {
    let (oh, ow) = s.out_hw()?;
    let rows = used(s.h, s.kh, s.stride.0, s.pad.0, s.dilation.0, oh);
    let cols = used(s.w, s.kw, s.stride.1, s.pad.1, s.dilation.1, ow);
    let mut sectors = std::collections::BTreeSet::new();
    // One NCHW plane or one NHWC image; the others repeat it (sector-aligned or not, the count
    // per plane differs by at most one sector at its ends).
    for (iy, _) in rows.iter().enumerate().filter(|(_, &u)| u) {
        for (ix, _) in cols.iter().enumerate().filter(|(_, &u)| u) {
            let (first, len) = match s.format {
                TensorFormat::Nchw => ((iy * s.w + ix) * es, es),
                TensorFormat::Nhwc => ((iy * s.w + ix) * s.c_in * es, s.c_in * es),
            };
            for sector in first / 32..(first + len).div_ceil(32) {
                sectors.insert(sector);
            }
        }
    }
    let per = (sectors.len() * 32).min(match s.format {
        TensorFormat::Nchw => s.h * s.w * es,
        TensorFormat::Nhwc => s.h * s.w * s.c_in * es,
    });
    Ok(per
        * match s.format {
            TensorFormat::Nchw => s.n * s.c_in,
            TensorFormat::Nhwc => s.n,
        })
}

fn bench_layer<T: Element>(
    ctx: &Context,
    layer: &'static str,
    s: &ConvShape,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let dt = T::DTYPE;
    let es = dt.size();
    let n_cols = im2col::columns_len(s)?;
    let (x_bytes, cols_bytes) = (s.x_len().unwrap() * es, n_cols * es);
    let (k_im2col, k_col2im) = im2col::kernel_names(s, dt)?;
    let read = read_bytes(s, es)?;
    let l2 = ctx.info().l2_bytes.max(1) as usize;
    let copies = (2 * l2).div_ceil(x_bytes + cols_bytes) + 1;
    let stream = ctx.stream();
    let mut sets: Vec<(CudaSlice<T>, CudaSlice<T>)> = Vec::with_capacity(copies);
    for _ in 0..copies {
        let mut x = stream
            .alloc_zeros::<T>(s.x_len().unwrap())
            .context("alloc x")?;
        let mut c = stream.alloc_zeros::<T>(n_cols).context("alloc cols")?;
        util::fill(ctx, &mut x, T::from_f64(0.5))?;
        util::fill(ctx, &mut c, T::from_f64(0.25))?;
        sets.push((x, c));
    }
    // The same-size copies: half of each kernel's bytes read, half written.
    let bytes_of = [cols_bytes + read, cols_bytes + x_bytes];
    let mut copy_sets: Vec<Vec<(CudaSlice<u8>, CudaSlice<u8>)>> = Vec::new();
    for &b in &bytes_of {
        let half = (b / 2).max(1);
        let n = (2 * l2).div_ceil(2 * half) + 1;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push((
                stream.alloc_zeros::<u8>(half).context("alloc copy src")?,
                stream.alloc_zeros::<u8>(half).context("alloc copy dst")?,
            ));
        }
        copy_sets.push(v);
    }
    for (op, kernel, bytes) in [
        ("im2col", k_im2col, bytes_of[0]),
        ("col2im", k_col2im, bytes_of[1]),
    ] {
        let which = usize::from(op == "col2im");
        let run = |sets: &mut Vec<(CudaSlice<T>, CudaSlice<T>)>, i: usize| {
            let (x, c) = &mut sets[i % copies];
            if which == 0 {
                im2col::im2col(ctx, s, &*x, c)
            } else {
                im2col::col2im(ctx, s, &*c, x)
            }
        };
        let single = time_gpu(ctx, single_opts(), |i| run(&mut sets, i))?;
        let cs = &mut copy_sets[which];
        let res = time_interleaved(ctx, BURST_OPTS, 2, |v, i| {
            if v == 0 {
                let n = cs.len();
                let (src, dst) = &mut cs[i % n];
                stream
                    .memcpy_dtod(&*src, dst)
                    .map_err(|e| nnfuse::Error::Driver {
                        call: "cuMemcpyDtoDAsync",
                        status: format!("{e:?}"),
                    })
            } else {
                run(&mut sets, i)
            }
        })?;
        for (v, e) in res.errors.iter().enumerate() {
            if let Some(e) = e {
                anyhow::bail!("{layer} {dt} {op}: variant {v} failed: {e}");
            }
        }
        let (copy, t) = (
            res.timing(0).context("same-size copy timing")?,
            res.timing(1).context("kernel timing")?,
        );
        rows.push(Row {
            layer,
            format: s.format,
            dtype: dt,
            op,
            kernel,
            bytes: bytes as f64,
            t,
            single,
            copy,
        });
    }
    ctx.synchronize()?;
    eprintln!(
        "  {layer} {dt} {:?}: {copies} buffer set(s) of {:.0} MB",
        s.format,
        (x_bytes + cols_bytes) as f64 / 1e6
    );
    Ok(())
}

fn layer(
    c: usize,
    hw: usize,
    k: usize,
    stride: usize,
    pad: usize,
    format: TensorFormat,
) -> ConvShape {
    ConvShape {
        n: 32,
        c_in: c,
        h: hw,
        w: hw,
        c_out: c,
        kh: k,
        kw: k,
        stride: (stride, stride),
        pad: (pad, pad),
        dilation: (1, 1),
        format,
    }
}

fn main() -> std::process::ExitCode {
    exit::finish("conv_kernels", run())
}

fn run() -> Result<()> {
    let ctx = Context::new(0).context("the conv_kernels benchmark needs a CUDA GPU")?;
    eprintln!("{}", ctx.info());
    let copy_bw = copy_bandwidth(&ctx, 1 << 30)?;
    eprintln!(
        "device copy bandwidth (read + write, 1 GiB): {:.0} GB/s",
        copy_bw / 1e9
    );
    let layers: [(&'static str, usize, usize, usize, usize, usize); 6] = [
        ("3x3 64@56", 64, 56, 3, 1, 1),
        ("3x3 128@28", 128, 28, 3, 1, 1),
        ("3x3 256@14", 256, 14, 3, 1, 1),
        ("3x3 512@7", 512, 7, 3, 1, 1),
        ("7x7/2 3@224", 3, 224, 7, 2, 3),
        ("1x1/2 256@56", 256, 56, 1, 2, 0),
    ];
    let mut rows = Vec::new();
    let started = std::time::Instant::now();
    for &(name, c, hw, k, stride, pad) in &layers {
        bench_layer::<f16>(
            &ctx,
            name,
            &layer(c, hw, k, stride, pad, TensorFormat::Nhwc),
            &mut rows,
        )?;
        bench_layer::<f32>(
            &ctx,
            name,
            &layer(c, hw, k, stride, pad, TensorFormat::Nchw),
            &mut rows,
        )?;
    }
    // The stem in f32 NHWC too: the 4-byte rows kernel.
    bench_layer::<f32>(
        &ctx,
        "7x7/2 3@224",
        &layer(3, 224, 7, 2, 3, TensorFormat::Nhwc),
        &mut rows,
    )?;
    eprintln!("measured in {:.1} s", started.elapsed().as_secs_f64());

    println!();
    println!(
        "im2col / col2im on {}, batch 32 — copy bandwidth {:.0} GB/s (read + write). Bytes = \
         columns + input (im2col: the input sectors some tap reads); floor = bytes / copy \
         bandwidth; times are medians of back-to-back launches (single: one launch between two \
         events, as first measured); same-size copy: a device copy of the same bytes, back to back; \
         target: im2col ≥ 80% of copy.",
        ctx.info().name,
        copy_bw / 1e9
    );
    println!();
    println!(
        "| layer | format | dtype | op | kernel | MB | µs | single µs | GB/s | floor µs | % of copy \
         | same-size copy µs | % of same-size copy | col2im : im2col |"
    );
    println!("|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        let ratio = if r.op == "col2im" {
            rows.iter()
                .find(|o| {
                    o.op == "im2col"
                        && o.layer == r.layer
                        && o.dtype == r.dtype
                        && o.format == r.format
                })
                .map(|o| format!("{:.2}x", r.t.median_ms / o.t.median_ms))
                .unwrap_or_default()
        } else {
            String::new()
        };
        println!(
            "| {} | {:?} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.0} | {:.1} | {:.0}% | {:.1} | {:.0}% | {} |",
            r.layer,
            r.format,
            r.dtype,
            r.op,
            r.kernel,
            r.bytes / 1e6,
            r.t.median_us(),
            r.single.median_us(),
            r.gbps(),
            r.floor_us(copy_bw),
            r.pct_copy(copy_bw),
            r.copy.median_us(),
            r.pct_same_copy(),
            ratio
        );
    }
    let im2col_rows: Vec<&Row> = rows.iter().filter(|r| r.op == "im2col").collect();
    let worst = |key: &dyn Fn(&Row) -> f64| {
        im2col_rows
            .iter()
            .map(|r| (key(r), *r))
            .min_by(|a, b| a.0.total_cmp(&b.0))
    };
    if let Some((pct, r)) = worst(&|r| r.pct_copy(copy_bw)) {
        println!();
        println!(
            "im2col: lowest {pct:.0}% of copy bandwidth back to back ({} {} {:?}, {}); target \
             80%: {}",
            r.layer,
            r.dtype,
            r.format,
            r.kernel,
            if pct >= 80.0 { "met" } else { "NOT met" }
        );
    }
    if let Some((pct, r)) = worst(&|r| 100.0 * r.floor_us(copy_bw) / r.single.median_us()) {
        println!(
            "im2col: lowest {pct:.0}% of copy bandwidth in single launches (the first measurements' method; {} \
             {} {:?})",
            r.layer, r.dtype, r.format
        );
    }
    if let Some((pct, r)) = worst(&|r| r.pct_same_copy()) {
        println!(
            "im2col: lowest {pct:.0}% of a same-size device copy ({} {} {:?})",
            r.layer, r.dtype, r.format
        );
    }
    println!();
    println!(
        "{}",
        serde_json::json!({
            "bench": "conv_kernels",
            "device": ctx.info().name,
            "copy_bandwidth_gbps": copy_bw / 1e9,
        })
    );
    for r in &rows {
        println!(
            "{}",
            serde_json::json!({
                "bench": "conv_kernels",
                "layer": r.layer,
                "batch": 32,
                "format": format!("{:?}", r.format).to_lowercase(),
                "dtype": r.dtype.name(),
                "op": r.op,
                "kernel": r.kernel,
                "bytes": r.bytes,
                "timing": "back-to-back",
                "median_us": r.t.median_us(),
                "p10_us": r.t.p10_ms * 1e3,
                "p90_us": r.t.p90_ms * 1e3,
                "rounds": r.t.iters,
                "single_launch_us": r.single.median_us(),
                "same_size_copy_us": r.copy.median_us(),
                "pct_same_size_copy": r.pct_same_copy(),
                "gbps": r.gbps(),
                "floor_us": r.floor_us(copy_bw),
                "pct_copy": r.pct_copy(copy_bw),
            })
        );
    }
    Ok(())
}
