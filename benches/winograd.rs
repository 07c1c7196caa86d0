//! Winograd convolution, stage by stage, and the seed's tensor-core rule on the H100.
//!
//! Part 1, stages: for the 3x3 layers of ResNet-50 (64→64 at 56², 128→128 at 28², 256→256 at
//! 14², 512→512 at 7²), batch 32 and 64, f16 and bf16 NHWC, both tiles F(2x2,3x3) and
//! F(4x4,3x3): the time of each stage (input transform, filter transform, batched multiply by
//! the tensor-core GEMM and by the Direct batched multiply, output transform) next to its floor
//! (the transforms: minimal bytes read + written at the copy bandwidth measured in this run; the
//! multiply: the larger of its bytes at that bandwidth and its FLOPs at the peak), and the whole
//! path as the dispatcher runs it (`winograd_stages::forward`: filter transform included,
//! chunked under the workspace cap) for each engine, in direct-convolution TFLOP/s
//! (2·N·K·C·9·OH·OW, the number every convolution path is compared by), with the ratios F(4x4) /
//! F(2x2) and Direct / tensor core, and the tensor-core path again with L2-resident chunks
//! instead of the default workspace-cap chunk (`Chunking`; measured slower, kept as the
//! comparison). Stage timings rotate among enough buffer sets that each iteration's data has
//! left the 50 MiB L2 (cold); the whole path rotates x and y only, so its
//! U and M are as warm as they are in use. The comparison with cuDNN and im2col + GEMM on the
//! same layers is `benches/conv.rs`'s.
//!
//! The fused engine (`WinogradEngine::Fused`, f16/bf16): the whole path (filter transform +
//! fused kernel) and the fused kernel alone on a prepared filter, with its floor: the larger of
//! x + V + y at the copy bandwidth and the Winograd-domain product's FLOPs (2·alpha²·T·C·K) at
//! the tensor peak; the totals table compares it with the tensor-core path.
//!
//! Part 2, transform variants: each transform at every vector width the channels allow (16-,
//! 4- and 2-byte accesses for 16-bit types), batch 32.
//!
//! Part 3, the seed's rule: the batched multiply of Winograd problems (36 positions, m = C_out,
//! n = tiles, k = C_in) by nnfuse's tuned GEMM (tensor cores) and by the Direct batched
//! multiply, for shapes the rule sends to tensor cores and shapes it sends to Direct (C = 30,
//! 129; tiles not divisible by 8), with the verdict "rule right" when the engine the rule picks
//! is the faster one.
//!
//! Prints markdown tables, a summary, then one JSON object per line (`{"bench":"winograd",...}`).
//! `cargo bench --bench winograd` on a GPU; `NNFUSE_BENCH_QUICK=1` runs batch 32 and f16 only.
//! About a minute on an H100.

#[path = "support/exit.rs"]
mod exit;
#[path = "support/shapes.rs"]
mod shapes;

use std::time::Instant;

use anyhow::{Context as _, Result};
use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use nnfuse::conv::{ConvShape, WinogradEngine, WinogradTile};
use nnfuse::gemm::{self, Problem};
use nnfuse::internals::conv::{tensor_core_rule, winograd_dims, winograd_stages as wg};
use nnfuse::internals::timing::{copy_bandwidth, time_gpu, Timing, TimingOptions};
use nnfuse::{Context, DType, Element};
use serde_json::json;

/// Dense f16/bf16 tensor-core peak assumed for the FLOP floor: the 700–740 TFLOP/s measured
/// with a bf16 8192³ GEMM (docs/CUDNN-FACTS.md).
const TENSOR_PEAK: f64 = 740e12;
/// FP32 (non-tensor) FMA peak of an H100 SXM, the ceiling of the Direct batched multiply:
/// 132 SMs x 128 lanes x 2 FLOP x 1.98 GHz.
const FP32_PEAK: f64 = 67e12;
/// Bytes after which the L2 (50 MiB) no longer holds an earlier iteration's data.
const L2_ROTATE: usize = 120 << 20;

fn opts(budget_ms: f64) -> TimingOptions {
    TimingOptions {
        warmup: 3,
        max_iters: 100,
        min_iters: 10,
        budget_ms,
    }
}

fn err(e: impl std::fmt::Debug) -> anyhow::Error {
    anyhow::anyhow!("{e:?}")
}

fn layer(n: usize, c: usize, hw: usize) -> ConvShape {
    shapes::square3x3(n, c, hw, c)
}

fn conv_flops(s: &ConvShape) -> f64 {
    let (oh, ow) = s.out_hw().unwrap_or((0, 0));
    2.0 * (s.n * s.c_out * s.c_in * 9 * oh * ow) as f64
}

fn alloc<T: Element>(ctx: &Context, n: usize, seed: u64) -> Result<CudaSlice<T>> {
    let mut b = ctx.stream().alloc_zeros::<T>(n.max(1)).map_err(err)?;
    nnfuse::internals::gemm::fill_uniform(ctx, &mut b, seed)?;
    Ok(b)
}

/// Buffers of one layer, `sets` copies of everything a stage reads or writes.
struct Sets<T> {
    x: Vec<CudaSlice<T>>,
    w: CudaSlice<T>,
    v: Vec<CudaSlice<T>>,
    u: Vec<CudaSlice<T>>,
    m: Vec<CudaSlice<T>>,
    y: Vec<CudaSlice<T>>,
}

/// One measured row.
#[derive(Clone)]
struct Row {
    dtype: DType,
    layer: String,
    n: usize,
    tile: WinogradTile,
    what: String,
    t: Timing,
    floor_us: f64,
    /// Bytes (transforms) or FLOPs (multiply, total) behind the floor.
    work: String,
    note: String,
}

fn print_rows(title: &str, rows: &[Row]) {
    println!("\n### {title}\n");
    println!(
        "| dtype | layer | N | tile | stage | median µs | floor µs | floor/time | work | note |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.0}% | {} | {} |",
            r.dtype,
            r.layer,
            r.n,
            r.tile.name(),
            r.what,
            r.t.median_us(),
            r.floor_us,
            100.0 * r.floor_us / r.t.median_us(),
            r.work,
            r.note
        );
    }
}

fn json_row(r: &Row) {
    println!(
        "{}",
        json!({
            "bench": "winograd",
            "part": "stages",
            "dtype": r.dtype.name(),
            "layer": r.layer,
            "n": r.n,
            "tile": r.tile.name(),
            "stage": r.what,
            "median_us": r.t.median_us(),
            "p10_us": r.t.p10_ms * 1e3,
            "p90_us": r.t.p90_ms * 1e3,
            "floor_us": r.floor_us,
            "work": r.work,
            "note": r.note,
        })
    );
}

/// Totals of one (layer, batch, dtype, tile): whole-path time per engine.
struct Total {
    dtype: DType,
    layer: String,
    n: usize,
    tile: WinogradTile,
    flops: f64,
    tc_us: f64,
    direct_us: f64,
    stages_tc_us: f64,
    /// Tensor-core path with L2-resident chunks.
    l2_us: f64,
    /// Host time of queuing one tensor-core forward.
    host_us: f64,
    /// The fused engine's whole path (filter transform included) and its kernel alone.
    fused_us: Option<f64>,
    fused_kernel_us: Option<f64>,
    /// Host time of queuing one fused forward.
    fused_host_us: Option<f64>,
}

#[allow(clippy::too_many_arguments)]
fn bench_layer<T: Element>(
    ctx: &Context,
    s: &ConvShape,
    name: &str,
    bw: f64,
    rows: &mut Vec<Row>,
    totals: &mut Vec<Total>,
    variants: &mut Vec<Row>,
    with_variants: bool,
) -> Result<()> {
    let dt = T::DTYPE;
    let e = dt.size();
    for tile in WinogradTile::ALL {
        let d = winograd_dims(s, tile)?;
        let ylen = s.y_len()?;
        let set_bytes =
            e * (s.x_len().unwrap() + s.n * (d.u_per_image + d.m_per_image) + ylen + d.v);
        let copies = L2_ROTATE.div_ceil(set_bytes).clamp(1, 8);
        let sets = Sets::<T> {
            x: (0..copies)
                .map(|i| alloc::<T>(ctx, s.x_len().unwrap(), 10 + i as u64))
                .collect::<Result<_>>()?,
            w: alloc::<T>(ctx, s.w_len().unwrap(), 3)?,
            v: (0..copies)
                .map(|_| alloc::<T>(ctx, d.v, 4))
                .collect::<Result<_>>()?,
            u: (0..copies)
                .map(|_| alloc::<T>(ctx, s.n * d.u_per_image, 5))
                .collect::<Result<_>>()?,
            m: (0..copies)
                .map(|_| alloc::<T>(ctx, s.n * d.m_per_image, 6))
                .collect::<Result<_>>()?,
            y: (0..copies)
                .map(|_| alloc::<T>(ctx, ylen, 7))
                .collect::<Result<_>>()?,
        };
        let Sets {
            x,
            w,
            mut v,
            mut u,
            mut m,
            mut y,
        } = sets;
        // Real transformed operands for the multiply (and the GEMM search on its first call).
        for i in 0..copies {
            wg::filter_transform(ctx, s, tile, &w, &mut v[i])?;
            wg::input_transform(ctx, s, tile, &x[i], &mut u[i], None)?;
        }
        for engine in [WinogradEngine::TensorCore, WinogradEngine::Direct] {
            wg::batched_multiply(ctx, s, tile, engine, &v[0], &u[0], &mut m[0])?;
        }
        ctx.synchronize()?;
        let sb = wg::stage_bytes(s, tile, e)?;
        let floor = |bytes: usize| bytes as f64 / bw * 1e6;
        let tiles = s.n * d.tiles_per_image;
        let mult_flops = 2.0 * (d.positions * tiles * s.c_in * s.c_out) as f64;
        let mut push = |what: &str, t: Timing, floor_us: f64, work: String, note: String| {
            rows.push(Row {
                dtype: dt,
                layer: name.to_string(),
                n: s.n,
                tile,
                what: what.to_string(),
                t,
                floor_us,
                work,
                note,
            });
        };
        let o = opts(60.0);
        let mut vec_in = 0;
        let t_in = time_gpu(ctx, o, |i| {
            let k = i % copies;
            vec_in = wg::input_transform(ctx, s, tile, &x[k], &mut u[k], None)?;
            Ok(())
        })?;
        let name_in = wg::transform_kernel_name(dt, tile, false, vec_in).unwrap_or("?");
        push(
            "input transform",
            t_in,
            floor(sb.input),
            format!("{:.1} MB", sb.input as f64 / 1e6),
            name_in.to_string(),
        );
        let t_f = time_gpu(ctx, o, |i| {
            let k = i % copies;
            wg::filter_transform(ctx, s, tile, &w, &mut v[k])
        })?;
        push(
            "filter transform",
            t_f,
            floor(sb.filter),
            format!("{:.1} MB", sb.filter as f64 / 1e6),
            String::new(),
        );
        let mut mult = [0.0; 2];
        for (ei, engine) in [WinogradEngine::TensorCore, WinogradEngine::Direct]
            .into_iter()
            .enumerate()
        {
            let t = time_gpu(ctx, o, |i| {
                let k = i % copies;
                wg::batched_multiply(ctx, s, tile, engine, &v[k], &u[k], &mut m[k])
            })?;
            let peak = if engine == WinogradEngine::TensorCore {
                TENSOR_PEAK
            } else {
                FP32_PEAK
            };
            let fl = (mult_flops / peak * 1e6).max(floor(sb.multiply));
            let rule = match tensor_core_rule(tiles, s.c_in, s.c_out) {
                Some(r) => format!("rule: tensor cores {r:?}"),
                None => "rule: Direct".to_string(),
            };
            mult[ei] = t.median_us();
            push(
                &format!("multiply {}", engine.name()),
                t,
                fl,
                format!(
                    "{:.2} GFLOP, {:.1} MB",
                    mult_flops / 1e9,
                    sb.multiply as f64 / 1e6
                ),
                format!(
                    "{:.0} TFLOP/s; {rule}",
                    mult_flops / (t.median_ms * 1e-3) / 1e12
                ),
            );
        }
        let mut vec_out = 0;
        let t_out = time_gpu(ctx, o, |i| {
            let k = i % copies;
            vec_out = wg::output_transform(ctx, s, tile, &m[k], &mut y[k], None)?;
            Ok(())
        })?;
        let name_out = wg::transform_kernel_name(dt, tile, true, vec_out).unwrap_or("?");
        push(
            "output transform",
            t_out,
            floor(sb.output),
            format!("{:.1} MB", sb.output as f64 / 1e6),
            name_out.to_string(),
        );
        let stages_tc_us = t_in.median_us() + t_f.median_us() + mult[0] + t_out.median_us();
        // The whole path (filter transform included), x and y rotated.
        let flops = conv_flops(s);
        let mut path = [0.0; 2];
        for (ei, engine) in [WinogradEngine::TensorCore, WinogradEngine::Direct]
            .into_iter()
            .enumerate()
        {
            let t = time_gpu(ctx, o, |i| {
                let k = i % copies;
                wg::forward(ctx, s, tile, engine, &x[k], &w, &mut y[k])
            })?;
            path[ei] = t.median_us();
            let all = sb.input + sb.filter + sb.multiply + sb.output;
            push(
                &format!("forward {}", engine.name()),
                t,
                floor(all),
                format!("{:.2} GFLOP (direct conv)", flops / 1e9),
                format!(
                    "{:.0} TFLOP/s effective",
                    flops / (t.median_ms * 1e-3) / 1e12
                ),
            );
        }
        // Host time of queuing one tensor-core forward (validation, chunk plan, launches, GEMM
        // lookup): when it exceeds the GPU time the path is launch-bound.
        ctx.synchronize()?;
        let calls = 30;
        let t0 = Instant::now();
        for i in 0..calls {
            let k = i % copies;
            wg::forward(
                ctx,
                s,
                tile,
                WinogradEngine::TensorCore,
                &x[k],
                &w,
                &mut y[k],
            )?;
        }
        let host_us = t0.elapsed().as_secs_f64() * 1e6 / calls as f64;
        ctx.synchronize()?;
        // The same path with L2-resident chunks (U and M of a chunk within half the L2): the
        // alternative the default (one workspace-cap chunk) was measured against.
        let l2 = wg::Chunking::L2Resident {
            l2_bytes: ctx.info().l2_bytes.max(0) as usize,
        };
        let t_l2 = time_gpu(ctx, o, |i| {
            let k = i % copies;
            wg::forward_chunked(
                ctx,
                s,
                tile,
                WinogradEngine::TensorCore,
                &x[k],
                &w,
                &mut y[k],
                l2,
            )
        })?;
        push(
            "forward tensor_core, L2-resident chunks",
            t_l2,
            floor(sb.input + sb.filter + sb.multiply + sb.output),
            format!("{:.2} GFLOP (direct conv)", flops / 1e9),
            format!(
                "{:.0} TFLOP/s effective; L2-resident/cap {:.2}x",
                flops / (t_l2.median_ms * 1e-3) / 1e12,
                t_l2.median_us() / path[0]
            ),
        );
        // The fused engine: the whole path, and the kernel alone on the prepared filter.
        let mut fused = (None, None, None);
        if nnfuse::internals::conv::fused_eligible(s, dt).is_ok() {
            let t = time_gpu(ctx, o, |i| {
                let k = i % copies;
                wg::forward(ctx, s, tile, WinogradEngine::Fused, &x[k], &w, &mut y[k])
            })?;
            let v_bytes = d.v * e;
            let xy = (s.x_len().unwrap() + ylen) * e;
            push(
                "forward fused",
                t,
                (floor(xy + sb.filter + v_bytes)).max(mult_flops / TENSOR_PEAK * 1e6),
                format!("{:.2} GFLOP (direct conv)", flops / 1e9),
                format!(
                    "{:.0} TFLOP/s effective; tensor_core/fused {:.2}x",
                    flops / (t.median_ms * 1e-3) / 1e12,
                    path[0] / t.median_us()
                ),
            );
            let tk = time_gpu(ctx, o, |i| {
                let k = i % copies;
                wg::forward_prepared(ctx, s, tile, WinogradEngine::Fused, &x[k], &v[k], &mut y[k])
            })?;
            let kernel_floor = floor(xy + v_bytes).max(mult_flops / TENSOR_PEAK * 1e6);
            push(
                "fused kernel (prepared V)",
                tk,
                kernel_floor,
                format!(
                    "{:.2} GFLOP Winograd-domain, {:.1} MB",
                    mult_flops / 1e9,
                    (xy + v_bytes) as f64 / 1e6
                ),
                format!(
                    "{:.0} TFLOP/s Winograd-domain; {}",
                    mult_flops / (tk.median_ms * 1e-3) / 1e12,
                    if floor(xy + v_bytes) >= mult_flops / TENSOR_PEAK * 1e6 {
                        "floor: bytes"
                    } else {
                        "floor: FLOPs"
                    }
                ),
            );
            ctx.synchronize()?;
            let t0 = Instant::now();
            for i in 0..calls {
                let k = i % copies;
                wg::forward(ctx, s, tile, WinogradEngine::Fused, &x[k], &w, &mut y[k])?;
            }
            let fh = t0.elapsed().as_secs_f64() * 1e6 / calls as f64;
            ctx.synchronize()?;
            fused = (Some(t.median_us()), Some(tk.median_us()), Some(fh));
        }
        totals.push(Total {
            dtype: dt,
            layer: name.to_string(),
            n: s.n,
            tile,
            flops,
            tc_us: path[0],
            direct_us: path[1],
            stages_tc_us,
            l2_us: t_l2.median_us(),
            host_us,
            fused_us: fused.0,
            fused_kernel_us: fused.1,
            fused_host_us: fused.2,
        });
        if with_variants {
            for &vw in wg::vector_widths(dt) {
                if s.c_in % vw == 0 {
                    let t = time_gpu(ctx, o, |i| {
                        let k = i % copies;
                        wg::input_transform(ctx, s, tile, &x[k], &mut u[k], Some(vw)).map(|_| ())
                    })?;
                    variants.push(Row {
                        dtype: dt,
                        layer: name.to_string(),
                        n: s.n,
                        tile,
                        what: format!("input v{vw}"),
                        t,
                        floor_us: floor(sb.input),
                        work: format!("{:.1} MB", sb.input as f64 / 1e6),
                        note: wg::transform_kernel_name(dt, tile, false, vw)
                            .unwrap_or("?")
                            .to_string(),
                    });
                }
                if s.c_out % vw == 0 {
                    let t = time_gpu(ctx, o, |i| {
                        let k = i % copies;
                        wg::output_transform(ctx, s, tile, &m[k], &mut y[k], Some(vw)).map(|_| ())
                    })?;
                    variants.push(Row {
                        dtype: dt,
                        layer: name.to_string(),
                        n: s.n,
                        tile,
                        what: format!("output v{vw}"),
                        t,
                        floor_us: floor(sb.output),
                        work: format!("{:.1} MB", sb.output as f64 / 1e6),
                        note: wg::transform_kernel_name(dt, tile, true, vw)
                            .unwrap_or("?")
                            .to_string(),
                    });
                }
            }
        }
        // Free this tile's buffers before the next.
        drop((x, w, v, u, m, y));
        ctx.synchronize()?;
    }
    Ok(())
}

/// One rule-study problem: 36 positions of (tiles x C_in) · (C_in x C_out).
struct RuleRow {
    dtype: DType,
    tiles: usize,
    c_in: usize,
    c_out: usize,
    rule: Option<(usize, usize, usize)>,
    tc: Timing,
    direct: Timing,
    flops: f64,
}

fn rule_case<T: Element>(
    ctx: &Context,
    tiles: usize,
    c_in: usize,
    c_out: usize,
) -> Result<RuleRow> {
    let positions = 36;
    let p = Problem {
        trans_a: false,
        trans_b: false,
        m: c_out,
        n: tiles,
        k: c_in,
        lda: c_out,
        ldb: c_in,
        ldc: c_out,
        stride_a: c_in * c_out,
        stride_b: tiles * c_in,
        stride_c: tiles * c_out,
        batch: positions,
        alpha: 1.0,
        beta: 0.0,
        compute: gemm::Compute::F32,
    };
    let set = e_bytes::<T>(positions * (c_in * c_out + tiles * (c_in + c_out)));
    let copies = L2_ROTATE.div_ceil(set.max(1)).clamp(1, 8);
    let a: Vec<CudaSlice<T>> = (0..copies)
        .map(|i| alloc::<T>(ctx, positions * c_in * c_out, 20 + i as u64))
        .collect::<Result<_>>()?;
    let b: Vec<CudaSlice<T>> = (0..copies)
        .map(|i| alloc::<T>(ctx, positions * tiles * c_in, 30 + i as u64))
        .collect::<Result<_>>()?;
    let mut c: Vec<CudaSlice<T>> = (0..copies)
        .map(|_| alloc::<T>(ctx, positions * tiles * c_out, 40))
        .collect::<Result<_>>()?;
    // First call: the tuned GEMM's search (on these operands), outside the timing.
    gemm::strided_batched(ctx, &p, &a[0], &b[0], &mut c[0])?;
    wg::direct_gemm(ctx, &p, &a[0], &b[0], &mut c[0])?;
    ctx.synchronize()?;
    let o = opts(60.0);
    let tc = time_gpu(ctx, o, |i| {
        let k = i % copies;
        gemm::strided_batched(ctx, &p, &a[k], &b[k], &mut c[k])
    })?;
    let direct = time_gpu(ctx, o, |i| {
        let k = i % copies;
        wg::direct_gemm(ctx, &p, &a[k], &b[k], &mut c[k])
    })?;
    Ok(RuleRow {
        dtype: T::DTYPE,
        tiles,
        c_in,
        c_out,
        rule: tensor_core_rule(tiles, c_in, c_out),
        tc,
        direct,
        flops: p.flops(),
    })
}

fn e_bytes<T: Element>(n: usize) -> usize {
    n * T::DTYPE.size()
}

fn main() -> std::process::ExitCode {
    exit::finish("winograd", run())
}

fn run() -> Result<()> {
    let ctx = Context::new(0).context("the Winograd bench needs a CUDA GPU")?;
    println!("# Winograd bench on {}", ctx.info());
    let quick = std::env::var("NNFUSE_BENCH_QUICK").is_ok_and(|v| v == "1");
    let bw = copy_bandwidth(&ctx, 1 << 30)?;
    println!(
        "copy bandwidth {:.2} TB/s (read + write); tensor peak assumed {:.0} TFLOP/s, FP32 peak {:.0} TFLOP/s; workspace cap {} MiB",
        bw / 1e12,
        TENSOR_PEAK / 1e12,
        FP32_PEAK / 1e12,
        ctx.config().conv_workspace_mb
    );
    let layers = [(64, 56), (128, 28), (256, 14), (512, 7)];
    let batches: &[usize] = if quick { &[32] } else { &[32, 64] };
    let mut rows = Vec::new();
    let mut totals = Vec::new();
    let mut variants = Vec::new();
    let dtypes: &[DType] = if quick {
        &[DType::F16]
    } else {
        &[DType::F16, DType::BF16]
    };
    for &dt in dtypes {
        for &(c, hw) in &layers {
            for &n in batches {
                let s = layer(n, c, hw);
                let name = format!("{c}->{c}@{hw}x{hw}");
                let with_variants = n == 32;
                eprintln!("[winograd bench] {dt} {name} N={n}");
                match dt {
                    DType::F16 => bench_layer::<f16>(
                        &ctx,
                        &s,
                        &name,
                        bw,
                        &mut rows,
                        &mut totals,
                        &mut variants,
                        with_variants,
                    )?,
                    _ => bench_layer::<bf16>(
                        &ctx,
                        &s,
                        &name,
                        bw,
                        &mut rows,
                        &mut totals,
                        &mut variants,
                        with_variants,
                    )?,
                }
            }
        }
    }
    print_rows(
        "Stages (cold L2) and the whole path (forward, filter transform included)",
        &rows,
    );
    print_rows(
        "Transform variants (channels per thread), batch 32",
        &variants,
    );

    println!("\n### Totals: the whole Winograd forward per tile and engine\n");
    println!("| dtype | layer | N | tile | tensor core µs | TFLOP/s | Direct µs | Direct/TC | L2 chunks µs | sum of cold stages (TC) µs | host µs/call | F4/F2 (TC) | fused µs | TFLOP/s | TC/fused | fused kernel µs | fused host µs/call |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for t in &totals {
        let f2 = totals
            .iter()
            .find(|o| {
                o.dtype == t.dtype
                    && o.layer == t.layer
                    && o.n == t.n
                    && o.tile == WinogradTile::F2x3
            })
            .map(|o| o.tc_us);
        let opt = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"));
        println!(
            "| {} | {} | {} | {} | {:.1} | {:.0} | {:.1} | {:.2}x | {:.1} | {:.1} | {:.1} | {} | {} | {} | {} | {} | {} |",
            t.dtype,
            t.layer,
            t.n,
            t.tile.name(),
            t.tc_us,
            t.flops / (t.tc_us * 1e-6) / 1e12,
            t.direct_us,
            t.direct_us / t.tc_us,
            t.l2_us,
            t.stages_tc_us,
            t.host_us,
            match (t.tile, f2) {
                (WinogradTile::F4x3, Some(f2)) => format!("{:.2}x", t.tc_us / f2),
                _ => "-".into(),
            },
            opt(t.fused_us),
            t.fused_us
                .map_or_else(|| "-".into(), |f| format!("{:.0}", t.flops / (f * 1e-6) / 1e12)),
            t.fused_us
                .map_or_else(|| "-".into(), |f| format!("{:.2}x", t.tc_us / f)),
            opt(t.fused_kernel_us),
            opt(t.fused_host_us),
        );
    }

    // Part 3: the seed's rule.
    let mut rule_rows = Vec::new();
    // (tiles, C_in, C_out) of the batched multiply; tiles = N x tiles per image.
    let cases = [
        (6272, 64, 64),   // 64@56², N=32, F(4x4): passes (16, 16, 16)
        (6272, 30, 30),   // C = 30: fails
        (6272, 129, 129), // C = 129: fails
        (6272, 64, 30),   // C_out = 30: fails
        (196, 64, 64),    // 64@56², N=1, F(4x4): 196 % 8 != 0 fails
        (1568, 128, 128), // 128@28², N=32, F(4x4): passes
        (100, 256, 256),  // 100 tiles: fails (100 % 8 != 0)
        (784, 256, 256),  // 256@14², N=49, F(4x4): passes
        (128, 512, 512),  // 512@7², N=32, F(4x4): passes
        (12, 512, 512),   // 512@7², N=3, F(4x4): fails (12 % 8 != 0)
        (25088, 64, 64),  // 64@56², N=32, F(2x2): passes
        (25088, 30, 64),  // C_in = 30: fails
    ];
    for &dt in dtypes {
        for &(tiles, ci, co) in &cases {
            eprintln!("[winograd bench] rule {dt} tiles {tiles} C_in {ci} C_out {co}");
            let r = match dt {
                DType::F16 => rule_case::<f16>(&ctx, tiles, ci, co)?,
                _ => rule_case::<bf16>(&ctx, tiles, ci, co)?,
            };
            rule_rows.push(r);
        }
    }
    println!("\n### The seed's tensor-core rule: tuned GEMM (tensor cores) vs the Direct batched multiply\n");
    println!("| dtype | tiles | C_in | C_out | rule says | TC µs | TC TFLOP/s | Direct µs | Direct TFLOP/s | Direct/TC | faster | rule right? |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut right = 0;
    for r in &rule_rows {
        let ratio = r.direct.median_ms / r.tc.median_ms;
        let faster = if ratio > 1.0 { "tensor core" } else { "Direct" };
        let says = match r.rule {
            Some(t) => format!("tensor core {t:?}"),
            None => "Direct".into(),
        };
        let ok = r.rule.is_some() == (ratio > 1.0);
        right += usize::from(ok);
        println!(
            "| {} | {} | {} | {} | {} | {:.1} | {:.0} | {:.1} | {:.0} | {:.2}x | {} | {} |",
            r.dtype,
            r.tiles,
            r.c_in,
            r.c_out,
            says,
            r.tc.median_us(),
            r.flops / (r.tc.median_ms * 1e-3) / 1e12,
            r.direct.median_us(),
            r.flops / (r.direct.median_ms * 1e-3) / 1e12,
            ratio,
            faster,
            if ok { "yes" } else { "no" }
        );
    }
    println!(
        "\nSummary: the seed's rule picked the faster engine on {right} of {} problems. Policy `seed` \
         follows the rule; `auto` measures.",
        rule_rows.len()
    );
    let best = totals
        .iter()
        .filter(|t| t.tile == WinogradTile::F4x3)
        .map(|t| format!("{} {} N={} {:.1} µs", t.dtype, t.layer, t.n, t.tc_us))
        .collect::<Vec<_>>();
    println!("F(4x4,3x3) tensor-core totals: {}", best.join("; "));
    let fused = totals
        .iter()
        .filter_map(|t| {
            t.fused_us.map(|f| {
                format!(
                    "{} {} {} N={} {f:.1} µs (kernel {:.1})",
                    t.tile.name(),
                    t.dtype,
                    t.layer,
                    t.n,
                    t.fused_kernel_us.unwrap_or(f64::NAN)
                )
            })
        })
        .collect::<Vec<_>>();
    println!(
        "Fused totals (filter transform included): {}",
        fused.join("; ")
    );

    for r in rows.iter().chain(&variants) {
        json_row(r);
    }
    for t in &totals {
        println!(
            "{}",
            json!({
                "bench": "winograd", "part": "total", "dtype": t.dtype.name(), "layer": t.layer,
                "n": t.n, "tile": t.tile.name(), "tensor_core_us": t.tc_us,
                "direct_us": t.direct_us, "stages_tensor_core_us": t.stages_tc_us,
                "l2_chunks_us": t.l2_us, "host_us_per_call": t.host_us,
                "fused_us": t.fused_us, "fused_kernel_us": t.fused_kernel_us,
                "fused_host_us_per_call": t.fused_host_us,
                "tflops_tensor_core": t.flops / (t.tc_us * 1e-6) / 1e12,
            })
        );
    }
    for r in &rule_rows {
        println!(
            "{}",
            json!({
                "bench": "winograd", "part": "rule", "dtype": r.dtype.name(), "tiles": r.tiles,
                "c_in": r.c_in, "c_out": r.c_out, "rule_tensor_core": r.rule.is_some(),
                "tensor_core_us": r.tc.median_us(), "direct_us": r.direct.median_us(),
            })
        );
    }
    Ok(())
}
