//! Convolution benchmark: ResNet-50's layers (the four 3x3 convolutions, three 1x1 ones
//! including the stride-2 downsample, the 7x7/2 stem) at batch 32 and 64, f16 and bf16 NHWC and
//! f32 NCHW, forward and both gradients. Per layer, type and direction, every variant is timed
//! **interleaved** (`nnfuse::internals::timing::time_interleaved`, drift cancels in per-round ratios):
//! every usable cuDNN algorithm (cuDNN's heuristic list, workspace up to 1 GiB), nnfuse's own
//! paths (im2col + GEMM, Winograd F(2x2)/F(4x4) with every engine that can run the layer:
//! tensor-core GEMM, Direct, and the fused kernel for f16/bf16; the direct kernel), and the
//! `auto` dispatcher exactly as a user calls it. Reported: median time, TFLOP/s (direct-conv
//! FLOPs `2·N·K·C·R·S·OH·OW`), the physical floor (FLOPs over the datasheet peak or bytes over
//! the 3.0 TB/s copy bandwidth, whichever is larger), the ratio to cuDNN's best algorithm,
//! workspace bytes; `auto`'s choice and its first-call cost (and the same with cuDNN's Find as
//! the search, forward only); the cost of a cached `Conv2d::new`. A summary checks the issue's
//! targets; JSON lines follow for machines.
//!
//! `cargo bench --bench conv` (on a GPU). `NNFUSE_BENCH_QUICK=1` (or `--quick`): batch 32, f16
//! and f32 only. `NNFUSE_BENCH_FILTER=3x3` (or `--filter 3x3`): layers whose name contains it.
//! Input buffers rotate past the 50 MiB L2.

#[path = "support/exit.rs"]
mod exit;
#[path = "support/shapes.rs"]
mod shapes;

use std::hint::black_box;
use std::time::Instant;

use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use nnfuse::conv::{
    self, Conv2d, ConvPath, ConvShape, CudnnSearch, Direction, Route, WinogradEngine, WinogradTile,
};
use nnfuse::internals::conv::usable;
use nnfuse::internals::gemm::fill_uniform;
use nnfuse::internals::timing::{time_interleaved, InterleavedOptions, Paired, Timing};
use nnfuse::{Context, DType, Element, TensorFormat};
use serde_json::json;

/// H100 SXM datasheet peaks (dense): f16/bf16 tensor cores, f32 FMA (no TF32).
const PEAK_HALF_TFLOPS: f64 = 989.4;
const PEAK_F32_TFLOPS: f64 = 66.9;
/// Device-to-device copy bandwidth measured on the H100 (docs/CUDNN-FACTS.md).
const COPY_TBPS: f64 = 3.0;
/// Workspace cuDNN's listed algorithms may use in the bench (the dispatcher's cap is
/// `NNFUSE_CONV_WORKSPACE_MB`, 256 MiB by default: an algorithm above it is not `auto`'s).
const BENCH_CUDNN_WS: usize = 1 << 30;

const OPTS: InterleavedOptions = InterleavedOptions {
    warmup_rounds: 1,
    min_sample_ms: 0.2,
    max_burst: 64,
    min_rounds: 5,
    max_rounds: 20,
    budget_ms: 150.0,
};

struct Layer {
    name: &'static str,
    c: usize,
    hw: usize,
    k: usize,
    r: usize,
    stride: usize,
    pad: usize,
}

const LAYERS: [Layer; 8] = [
    Layer {
        name: "3x3 64@56",
        c: 64,
        hw: 56,
        k: 64,
        r: 3,
        stride: 1,
        pad: 1,
    },
    Layer {
        name: "3x3 128@28",
        c: 128,
        hw: 28,
        k: 128,
        r: 3,
        stride: 1,
        pad: 1,
    },
    Layer {
        name: "3x3 256@14",
        c: 256,
        hw: 14,
        k: 256,
        r: 3,
        stride: 1,
        pad: 1,
    },
    Layer {
        name: "3x3 512@7",
        c: 512,
        hw: 7,
        k: 512,
        r: 3,
        stride: 1,
        pad: 1,
    },
    Layer {
        name: "1x1 64->256@56",
        c: 64,
        hw: 56,
        k: 256,
        r: 1,
        stride: 1,
        pad: 0,
    },
    Layer {
        name: "1x1 256->64@56",
        c: 256,
        hw: 56,
        k: 64,
        r: 1,
        stride: 1,
        pad: 0,
    },
    Layer {
        name: "1x1/2 256->512@56",
        c: 256,
        hw: 56,
        k: 512,
        r: 1,
        stride: 2,
        pad: 0,
    },
    Layer {
        name: "7x7/2 3->64@224",
        c: 3,
        hw: 224,
        k: 64,
        r: 7,
        stride: 2,
        pad: 3,
    },
];

/// One timed variant.
struct Row {
    layer: &'static str,
    n: usize,
    dtype: DType,
    format: TensorFormat,
    direction: Direction,
    variant: String,
    kind: &'static str,
    timing: Option<Timing>,
    vs_cudnn_best: Option<Paired>,
    workspace: usize,
    tflops: f64,
    floor_us: f64,
    note: String,
}

/// One (layer, batch, type, direction).
struct Summary {
    layer: &'static str,
    n: usize,
    dtype: DType,
    direction: Direction,
    cudnn_best: Option<(String, f64)>,
    auto_route: String,
    auto_us: Option<f64>,
    auto_vs_cudnn: Option<Paired>,
    first_call_ms: f64,
    find_first_call_ms: Option<f64>,
    find_route: Option<String>,
    f4_tc_us: Option<f64>,
    im2col_us: Option<f64>,
    f4_vs_im2col: Option<Paired>,
    f4_vs_cudnn: Option<Paired>,
    /// F(4x4) by the fused engine (f16/bf16 layers it can run).
    f4_fused_us: Option<f64>,
    f4_fused_vs_im2col: Option<Paired>,
    f4_fused_vs_cudnn: Option<Paired>,
    /// F(2x2) by the fused engine.
    f2_fused_us: Option<f64>,
    /// Per Winograd tile: (seed rule's engine, measured faster engine).
    engines: Vec<(WinogradTile, WinogradEngine, Option<WinogradEngine>)>,
}

fn fmt_us(t: Option<f64>) -> String {
    t.map_or_else(|| "-".into(), |v| format!("{v:.1}"))
}

fn fmt_ratio(p: &Option<Paired>) -> String {
    p.map_or_else(|| "-".into(), |p| format!("{:.3}", p.median))
}

struct Buffers<T: Element> {
    x: Vec<CudaSlice<T>>,
    w: CudaSlice<T>,
    y: Vec<CudaSlice<T>>,
    dy: Vec<CudaSlice<T>>,
    dx: Vec<CudaSlice<T>>,
    dw: CudaSlice<T>,
}

fn buffers<T: Element>(ctx: &Context, s: &ConvShape) -> nnfuse::Result<Buffers<T>> {
    let st = ctx.stream();
    let e = T::DTYPE.size();
    let y_len = s.y_len()?;
    let per = (s.x_len().unwrap() + y_len) * e;
    let copies = (150usize << 20).div_ceil(per.max(1)).clamp(1, 8);
    let alloc = |n: usize, seed: u64| -> nnfuse::Result<CudaSlice<T>> {
        let mut b = st.alloc_zeros::<T>(n).map_err(|e| nnfuse::Error::Driver {
            call: "cuMemAlloc",
            status: format!("{e:?}"),
        })?;
        fill_uniform(ctx, &mut b, seed)?;
        Ok(b)
    };
    let mut b = Buffers {
        x: Vec::new(),
        w: alloc(s.w_len().unwrap(), 1)?,
        y: Vec::new(),
        dy: Vec::new(),
        dx: Vec::new(),
        dw: alloc(s.w_len().unwrap(), 2)?,
    };
    for i in 0..copies as u64 {
        b.x.push(alloc(s.x_len().unwrap(), 10 + i)?);
        b.y.push(alloc(y_len, 20 + i)?);
        b.dy.push(alloc(y_len, 30 + i)?);
        b.dx.push(alloc(s.x_len().unwrap(), 40 + i)?);
    }
    Ok(b)
}

/// Runs `d` with `route` (None: the dispatcher) on copy `i`.
fn launch<T: Element>(
    conv: &Conv2d<T>,
    b: &mut Buffers<T>,
    d: Direction,
    route: Option<Route>,
    i: usize,
) -> nnfuse::Result<()> {
    let c = i % b.x.len();
    match (d, route) {
        (Direction::Forward, Some(r)) => conv.forward_with(r, &b.x[c], &b.w, &mut b.y[c]),
        (Direction::Forward, None) => conv.forward(&b.x[c], &b.w, &mut b.y[c]),
        (Direction::BackwardData, Some(r)) => {
            conv.backward_data_with(r, &b.dy[c], &b.w, &mut b.dx[c])
        }
        (Direction::BackwardData, None) => conv.backward_data(&b.dy[c], &b.w, &mut b.dx[c]),
        (Direction::BackwardFilter, Some(r)) => {
            conv.backward_filter_with(r, &b.x[c], &b.dy[c], &mut b.dw, false)
        }
        (Direction::BackwardFilter, None) => {
            conv.backward_filter(&b.x[c], &b.dy[c], &mut b.dw, false)
        }
    }
}

/// The first call of `d` on a fresh Context (empty choice caches, handles made beforehand; the
/// process-wide GEMM choices of earlier calls stay): host wall time including the
/// synchronisation, and the choice.
fn first_call<T: Element>(
    ctx: &Context,
    s: &ConvShape,
    b: &mut Buffers<T>,
    d: Direction,
) -> nnfuse::Result<(f64, Conv2d<T>, Context)> {
    conv::clear_choices();
    let fresh = ctx.with_config_override(ctx.config().clone());
    {
        // An application's Context has its library handles already; a new problem's first call
        // should not be charged for making them (kernel modules still load per Context).
        let mut g = fresh.lock()?;
        let _ = g.cudnn();
        let _ = g.cublas();
        let _ = g.cublaslt();
    }
    let c = Conv2d::<T>::new(&fresh, s)?;
    fresh.synchronize()?;
    let t = Instant::now();
    launch(&c, b, d, None, 0)?;
    fresh.synchronize()?;
    Ok((t.elapsed().as_secs_f64() * 1e3, c, fresh))
}

fn bench_config<T: Element>(
    ctx: &Context,
    layer: &Layer,
    n: usize,
    format: TensorFormat,
    rows: &mut Vec<Row>,
    sums: &mut Vec<Summary>,
) -> nnfuse::Result<()> {
    let s = ConvShape {
        n,
        c_in: layer.c,
        h: layer.hw,
        w: layer.hw,
        c_out: layer.k,
        kh: layer.r,
        kw: layer.r,
        stride: (layer.stride, layer.stride),
        pad: (layer.pad, layer.pad),
        dilation: (1, 1),
        format,
    };
    let dt = T::DTYPE;
    let conv = Conv2d::<T>::new(ctx, &s)?;
    let mut b = buffers::<T>(ctx, &s)?;
    let flops = conv.plan().flops;
    let peak = if dt == DType::F32 {
        PEAK_F32_TFLOPS
    } else {
        PEAK_HALF_TFLOPS
    };
    let (oh, ow) = s.out_hw()?;
    let y_len = s.n * s.c_out * oh * ow;
    for d in Direction::ALL {
        let bytes = (s.x_len().unwrap() + s.w_len().unwrap() + y_len) * dt.size();
        let floor_us = (flops / (peak * 1e12)).max(bytes as f64 / (COPY_TBPS * 1e12)) * 1e6;
        // The variants.
        let mut variants: Vec<(String, &'static str, Option<Route>, usize)> = Vec::new();
        let plan = conv.plan_for(d);
        if plan.eligible(ConvPath::Cudnn) {
            let list = conv.cudnn_heuristics(d)?;
            let (ok, _, _) = usable(&list, dt, BENCH_CUDNN_WS, false);
            for p in ok {
                variants.push((
                    format!("cudnn:{}", p.algo.label()),
                    "cudnn",
                    Some(Route::cudnn(p.algo)),
                    p.memory,
                ));
            }
        }
        for p in [
            ConvPath::Im2colGemm,
            ConvPath::WinogradF4x3,
            ConvPath::WinogradF2x3,
            ConvPath::Direct,
        ] {
            if !plan.eligible(p) {
                continue;
            }
            let ws = plan.info(p).scratch_bytes;
            match p.winograd_tile() {
                Some(t) => {
                    for e in [WinogradEngine::TensorCore, WinogradEngine::Direct] {
                        let r = Route::winograd(t, e);
                        variants.push((r.label(), "own", Some(r), ws));
                    }
                    let fused_ok = plan
                        .info(p)
                        .winograd
                        .as_ref()
                        .is_some_and(|w| w.fused_why_not.is_none());
                    if fused_ok {
                        // Its scratch is the transformed filter only.
                        let v = t.positions() * s.c_in * s.c_out * dt.size();
                        let r = Route::winograd(t, WinogradEngine::Fused);
                        variants.push((r.label(), "own", Some(r), v));
                    }
                }
                None => variants.push((p.name().to_string(), "own", Some(Route::path(p)), ws)),
            }
        }
        // auto: first call on a fresh Context, then timed as a user calls it.
        let (first_ms, auto_conv, _auto_ctx) = first_call::<T>(ctx, &s, &mut b, d)?;
        let choice = auto_conv.choice(d);
        let auto_route = choice
            .as_ref()
            .map_or_else(|| "-".into(), |c| c.route.label());
        let auto_ws = choice
            .as_ref()
            .and_then(|c| auto_conv.workspace_bytes(d, c.route).ok())
            .unwrap_or(0);
        let mut find = (None, None);
        if d == Direction::Forward {
            conv::set_cudnn_search(CudnnSearch::Find);
            let r = first_call::<T>(ctx, &s, &mut b, d);
            conv::set_cudnn_search(CudnnSearch::Heuristic);
            if let Ok((ms, c, _)) = r {
                // (Own paths' GEMM searches were paid by the call above: not counted here.)
                find = (Some(ms), c.choice(d).map(|c| c.route.label()));
            }
        }
        let auto_index = variants.len();
        variants.push((format!("auto -> {auto_route}"), "auto", None, auto_ws));
        let res = time_interleaved(ctx, OPTS, variants.len(), |v, i| {
            if v == auto_index {
                launch(&auto_conv, &mut b, d, None, i)
            } else {
                launch(&conv, &mut b, d, variants[v].2, i)
            }
        })?;
        // cuDNN's best: the lowest median among its algorithms.
        let best = variants
            .iter()
            .enumerate()
            .filter(|(_, v)| v.1 == "cudnn")
            .filter_map(|(i, v)| res.timing(i).map(|t| (i, v.0.clone(), t.median_ms)))
            .min_by(|a, b| a.2.total_cmp(&b.2));
        let median = |i: usize| res.timing(i).map(|t| t.median_us());
        let find_idx = |label: &str| variants.iter().position(|v| v.0 == label);
        for (i, (label, kind, _, ws)) in variants.iter().enumerate() {
            let t = res.timing(i);
            rows.push(Row {
                layer: layer.name,
                n,
                dtype: dt,
                format,
                direction: d,
                variant: label.clone(),
                kind,
                timing: t,
                vs_cudnn_best: best.as_ref().and_then(|(bi, _, _)| res.paired(*bi, i)),
                workspace: *ws,
                tflops: t.map_or(f64::NAN, |t| flops / (t.median_ms * 1e-3) / 1e12),
                floor_us,
                note: res.errors[i].clone().unwrap_or_default(),
            });
        }
        let f4 = find_idx("winograd_f4x3/tensor_core");
        let f4_fused = find_idx("winograd_f4x3/fused");
        let f2_fused = find_idx("winograd_f2x3/fused");
        let im = find_idx("im2col_gemm");
        let mut engines = Vec::new();
        for t in WinogradTile::ALL {
            if let Some(w) = plan.info(ConvPath::winograd(t)).winograd.as_ref() {
                let tc = find_idx(&Route::winograd(t, WinogradEngine::TensorCore).label());
                let di = find_idx(&Route::winograd(t, WinogradEngine::Direct).label());
                let faster = match (tc.and_then(median), di.and_then(median)) {
                    (Some(a), Some(b)) => Some(if a <= b {
                        WinogradEngine::TensorCore
                    } else {
                        WinogradEngine::Direct
                    }),
                    _ => None,
                };
                engines.push((t, w.seed_engine, faster));
            }
        }
        sums.push(Summary {
            layer: layer.name,
            n,
            dtype: dt,
            direction: d,
            cudnn_best: best.as_ref().map(|(_, l, m)| (l.clone(), m * 1e3)),
            auto_route,
            auto_us: median(auto_index),
            auto_vs_cudnn: best
                .as_ref()
                .and_then(|(bi, _, _)| res.paired(*bi, auto_index)),
            first_call_ms: first_ms,
            find_first_call_ms: find.0,
            find_route: find.1,
            f4_tc_us: f4.and_then(median),
            im2col_us: im.and_then(median),
            f4_vs_im2col: match (im, f4) {
                (Some(a), Some(b)) => res.paired(a, b),
                _ => None,
            },
            f4_vs_cudnn: match (best.as_ref(), f4) {
                (Some((a, _, _)), Some(b)) => res.paired(*a, b),
                _ => None,
            },
            f4_fused_us: f4_fused.and_then(median),
            f4_fused_vs_im2col: match (im, f4_fused) {
                (Some(a), Some(b)) => res.paired(a, b),
                _ => None,
            },
            f4_fused_vs_cudnn: match (best.as_ref(), f4_fused) {
                (Some((a, _, _)), Some(b)) => res.paired(*a, b),
                _ => None,
            },
            f2_fused_us: f2_fused.and_then(median),
            engines,
        });
        let last = sums.last().map(|s| (s.auto_us, s.cudnn_best.clone()));
        eprintln!(
            "{:<20} n{n:<3} {dt:<4} {d:<16} {} variants, auto {} us ({}), cuDNN best {:?}, first call {first_ms:.0} ms",
            layer.name,
            variants.len(),
            fmt_us(last.as_ref().and_then(|l| l.0)),
            sums.last().map_or(String::new(), |s| s.auto_route.clone()),
            last.and_then(|l| l.1),
        );
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick")
        || std::env::var("NNFUSE_BENCH_QUICK").is_ok_and(|v| v == "1");
    let filter = args
        .iter()
        .position(|a| a == "--filter")
        .and_then(|i| args.get(i + 1).cloned())
        .or_else(|| std::env::var("NNFUSE_BENCH_FILTER").ok());
    let ctx = match Context::new(0) {
        Ok(c) => c,
        Err(e) => return exit::finish("conv", Err(e.into())),
    };
    println!("# Convolution benchmark\n\n{}\n", ctx.info());
    println!("config: {}", ctx.config().to_string().replace('\n', ", "));
    let t0 = Instant::now();
    let mut rows = Vec::new();
    let mut sums = Vec::new();
    let batches: &[usize] = if quick { &[32] } else { &[32, 64] };
    let types: &[(DType, TensorFormat)] = if quick {
        &[
            (DType::F16, TensorFormat::Nhwc),
            (DType::F32, TensorFormat::Nchw),
        ]
    } else {
        &[
            (DType::F16, TensorFormat::Nhwc),
            (DType::BF16, TensorFormat::Nhwc),
            (DType::F32, TensorFormat::Nchw),
        ]
    };
    for layer in &LAYERS {
        if filter
            .as_ref()
            .is_some_and(|f| !layer.name.contains(f.as_str()))
        {
            continue;
        }
        for &n in batches {
            for &(dt, fmt) in types {
                let r = match dt {
                    DType::F16 => bench_config::<f16>(&ctx, layer, n, fmt, &mut rows, &mut sums),
                    DType::BF16 => bench_config::<bf16>(&ctx, layer, n, fmt, &mut rows, &mut sums),
                    DType::F32 => bench_config::<f32>(&ctx, layer, n, fmt, &mut rows, &mut sums),
                };
                if let Err(e) = r {
                    eprintln!("{} n{n} {dt}: {e}", layer.name);
                }
            }
        }
    }

    // The cached lookup of a planned problem.
    let s = shapes::square3x3(32, 64, 56, 64);
    let lookup_ns = match Conv2d::<f16>::new(&ctx, &s) {
        Ok(_) => {
            let iters = 200_000;
            let t = Instant::now();
            for _ in 0..iters {
                black_box(Conv2d::<f16>::new(&ctx, black_box(&s)).ok());
            }
            t.elapsed().as_secs_f64() * 1e9 / iters as f64
        }
        Err(_) => f64::NAN,
    };

    // Per-variant table.
    println!("\n## Every variant\n");
    println!("| layer | n | dtype | dir | variant | median us | TFLOP/s | floor us | vs cuDNN best | workspace B | note |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} {} | {} | {} | {} | {:.1} | {:.1} | {} | {} | {} |",
            r.layer,
            r.n,
            r.dtype,
            r.format,
            r.direction,
            r.variant,
            fmt_us(r.timing.map(|t| t.median_us())),
            r.tflops,
            r.floor_us,
            fmt_ratio(&r.vs_cudnn_best),
            r.workspace,
            r.note
        );
    }
    println!("\n## Summary (auto and Winograd against cuDNN's best algorithm)\n");
    println!("| layer | n | dtype | dir | cuDNN best | us | auto | us | auto/best | first call ms | Find first call ms (route) | F4 TC us | im2col us | F4/im2col | F4/cuDNN | F4 fused us | F4 fused/im2col | F4 fused/cuDNN | F2 fused us |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for s in &sums {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            s.layer,
            s.n,
            s.dtype,
            s.direction,
            s.cudnn_best.as_ref().map_or("-".into(), |b| b.0.clone()),
            fmt_us(s.cudnn_best.as_ref().map(|b| b.1)),
            s.auto_route,
            fmt_us(s.auto_us),
            fmt_ratio(&s.auto_vs_cudnn),
            s.first_call_ms,
            match (&s.find_first_call_ms, &s.find_route) {
                (Some(m), Some(r)) => format!("{m:.1} ({r})"),
                _ => "-".into(),
            },
            fmt_us(s.f4_tc_us),
            fmt_us(s.im2col_us),
            fmt_ratio(&s.f4_vs_im2col),
            fmt_ratio(&s.f4_vs_cudnn),
            fmt_us(s.f4_fused_us),
            fmt_ratio(&s.f4_fused_vs_im2col),
            fmt_ratio(&s.f4_fused_vs_cudnn),
            fmt_us(s.f2_fused_us),
        );
    }

    // Targets.
    println!("\n## Targets\n");
    let slower: Vec<&Summary> = sums
        .iter()
        .filter(|s| s.auto_vs_cudnn.is_some_and(|p| p.median > 1.02))
        .collect();
    println!(
        "- auto within 2% of cuDNN's best: {} of {} cases over ({}).",
        slower.len(),
        sums.iter().filter(|s| s.auto_vs_cudnn.is_some()).count(),
        slower
            .iter()
            .map(|s| format!("{} n{} {} {}", s.layer, s.n, s.dtype, s.direction))
            .collect::<Vec<_>>()
            .join("; ")
    );
    let f4: Vec<&Summary> = sums
        .iter()
        .filter(|s| {
            s.dtype == DType::F16 && s.direction == Direction::Forward && s.f4_tc_us.is_some()
        })
        .collect();
    println!(
        "- Winograd F(4x4,3x3) f16 NHWC forward: >= 1.5x faster than im2col on {} of {} 3x3 layers; within 1.25x of cuDNN on {}; faster than cuDNN on {} (stretch).",
        f4.iter().filter(|s| s.f4_vs_im2col.is_some_and(|p| p.median <= 1.0 / 1.5)).count(),
        f4.len(),
        f4.iter().filter(|s| s.f4_vs_cudnn.is_some_and(|p| p.median <= 1.25)).count(),
        f4.iter().filter(|s| s.f4_vs_cudnn.is_some_and(|p| p.median < 1.0)).count(),
    );
    let fused: Vec<&Summary> = sums
        .iter()
        .filter(|s| {
            s.dtype == DType::F16 && s.direction == Direction::Forward && s.f4_fused_us.is_some()
        })
        .collect();
    println!(
        "- the same by the fused engine: >= 1.5x faster than im2col on {} of {}; within 1.25x of cuDNN on {}; faster than cuDNN on {} (stretch).",
        fused.iter().filter(|s| s.f4_fused_vs_im2col.is_some_and(|p| p.median <= 1.0 / 1.5)).count(),
        fused.len(),
        fused.iter().filter(|s| s.f4_fused_vs_cudnn.is_some_and(|p| p.median <= 1.25)).count(),
        fused.iter().filter(|s| s.f4_fused_vs_cudnn.is_some_and(|p| p.median < 1.0)).count(),
    );
    let over = sums.iter().filter(|s| s.first_call_ms >= 300.0).count();
    let mut firsts: Vec<f64> = sums.iter().map(|s| s.first_call_ms).collect();
    firsts.sort_by(|a, b| a.total_cmp(b));
    let med = firsts.get(firsts.len() / 2).copied().unwrap_or(f64::NAN);
    println!(
        "- auto's first call (measurement included): median {med:.0} ms, {over} of {} at or over 300 ms; max {:.0} ms.",
        sums.len(),
        firsts.last().copied().unwrap_or(f64::NAN)
    );
    let finds: Vec<f64> = sums.iter().filter_map(|s| s.find_first_call_ms).collect();
    if !finds.is_empty() {
        let mut f = finds.clone();
        f.sort_by(|a, b| a.total_cmp(b));
        println!(
            "- the same with cuDNN's Find as the cuDNN search (forward): median {:.0} ms, max {:.0} ms.",
            f[f.len() / 2],
            f[f.len() - 1]
        );
    }
    println!("- cached Conv2d::new: {lookup_ns:.0} ns per lookup (target < 1000).");
    let mut rule_right = 0;
    let mut rule_total = 0;
    for s in &sums {
        for (t, seed, faster) in &s.engines {
            if let Some(f) = faster {
                rule_total += 1;
                if f == seed {
                    rule_right += 1;
                }
                if f != seed {
                    println!(
                        "  - seed rule wrong: {} n{} {} {} {}: rule says {}, {} is faster",
                        s.layer,
                        s.n,
                        s.dtype,
                        s.direction,
                        t.name(),
                        seed.name(),
                        f.name()
                    );
                }
            }
        }
    }
    println!("- the seed's tensor-core rule picked the faster Winograd engine in {rule_right} of {rule_total} cases.");
    println!("\ntotal bench time {:.0} s", t0.elapsed().as_secs_f64());

    // JSON lines.
    for r in &rows {
        println!(
            "{}",
            json!({
                "bench": "conv", "layer": r.layer, "n": r.n, "dtype": r.dtype.name(),
                "format": r.format.name(), "direction": r.direction.name(), "variant": r.variant,
                "kind": r.kind,
                "median_us": r.timing.map(|t| t.median_us()),
                "p10_us": r.timing.map(|t| t.p10_ms * 1e3),
                "p90_us": r.timing.map(|t| t.p90_ms * 1e3),
                "tflops": r.tflops.is_finite().then_some(r.tflops),
                "floor_us": r.floor_us,
                "vs_cudnn_best": r.vs_cudnn_best.map(|p| p.median),
                "workspace_bytes": r.workspace,
                "error": (!r.note.is_empty()).then_some(&r.note),
            })
        );
    }
    for s in &sums {
        println!(
            "{}",
            json!({
                "bench": "conv_summary", "layer": s.layer, "n": s.n, "dtype": s.dtype.name(),
                "direction": s.direction.name(),
                "cudnn_best": s.cudnn_best.as_ref().map(|b| &b.0),
                "cudnn_best_us": s.cudnn_best.as_ref().map(|b| b.1),
                "auto_route": s.auto_route, "auto_us": s.auto_us,
                "auto_vs_cudnn_best": s.auto_vs_cudnn.map(|p| p.median),
                "first_call_ms": s.first_call_ms,
                "find_first_call_ms": s.find_first_call_ms, "find_route": s.find_route,
                "f4_tc_us": s.f4_tc_us, "im2col_us": s.im2col_us,
                "f4_vs_im2col": s.f4_vs_im2col.map(|p| p.median),
                "f4_vs_cudnn_best": s.f4_vs_cudnn.map(|p| p.median),
                "f4_fused_us": s.f4_fused_us,
                "f4_fused_vs_im2col": s.f4_fused_vs_im2col.map(|p| p.median),
                "f4_fused_vs_cudnn_best": s.f4_fused_vs_cudnn.map(|p| p.median),
                "f2_fused_us": s.f2_fused_us,
            })
        );
    }
    println!("{}", json!({ "bench": "conv_lookup", "ns": lookup_ns }));
    std::process::ExitCode::SUCCESS
}
