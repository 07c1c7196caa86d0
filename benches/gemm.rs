//! Strided batched GEMM benchmark: for each shape and type, the cuBLAS default, a few explicit
//! `cublasGemmAlgo_t` values (to show on the record whether they change anything on this GPU),
//! every cuBLASLt candidate of the search, and the tuned choice, in TFLOP/s against the measured
//! peak of a large bf16 GEMM in the same run; plus the cost of the search per shape and of a
//! cached lookup. Prints a markdown table, then JSON lines.
//!
//! `cargo bench --bench gemm` (on a GPU). `NNFUSE_BENCH_QUICK=1` runs two small shapes only.

use std::hint::black_box;
use std::process::ExitCode;
use std::time::Instant;

use half::{bf16, f16};
use nnfuse::gemm::{self, Algo, CublasAlgo, Outcome, Problem};
use nnfuse::timing::{time_gpu, Timing, TimingOptions};
use nnfuse::{Config, Context, DType, Element};
use serde_json::json;

/// One measured variant of one shape.
struct Row {
    dtype: DType,
    shape: (usize, usize, usize, usize),
    variant: String,
    timing: Option<Timing>,
    note: String,
    tflops: f64,
}

/// Per-GEMM timing of `f`: enough launches per sample to reach 20 µs, up to 200 samples or 40 ms.
fn measure(ctx: &Context, mut f: impl FnMut() -> nnfuse::Result<()>) -> nnfuse::Result<Timing> {
    let est = time_gpu(
        ctx,
        TimingOptions {
            warmup: 2,
            max_iters: 3,
            min_iters: 3,
            budget_ms: 0.0,
        },
        |_| f(),
    )?;
    let reps = ((0.02 / est.median_ms.max(1e-6)).ceil() as usize).clamp(1, 64);
    let t = time_gpu(
        ctx,
        TimingOptions {
            warmup: 2,
            max_iters: 200,
            min_iters: 10,
            budget_ms: 40.0,
        },
        |_| {
            for _ in 0..reps {
                f()?;
            }
            Ok(())
        },
    )?;
    let r = reps as f64;
    Ok(Timing {
        median_ms: t.median_ms / r,
        min_ms: t.min_ms / r,
        p10_ms: t.p10_ms / r,
        p90_ms: t.p90_ms / r,
        iters: t.iters,
    })
}

struct ShapeSummary {
    dtype: DType,
    shape: (usize, usize, usize, usize),
    search_ms: f64,
    lookup_ns: f64,
    candidates: usize,
    rejected: usize,
    winner: String,
    tuned_over_default: f64,
}

fn bench_shape<T: Element>(
    ctx: &Context,
    (batch, m, n, k): (usize, usize, usize, usize),
    rows: &mut Vec<Row>,
) -> nnfuse::Result<ShapeSummary> {
    let p = Problem::packed(batch, m, n, k);
    let s = ctx.stream();
    let alloc = |len: usize| {
        s.alloc_zeros::<T>(len)
            .map_err(|e| nnfuse::Error::NotSupported(format!("{e:?}")))
    };
    let mut a = alloc(batch * m * k)?;
    let mut b = alloc(batch * k * n)?;
    let mut c = alloc(batch * m * n)?;
    gemm::fill_uniform(ctx, &mut a, 1)?;
    gemm::fill_uniform(ctx, &mut b, 2)?;
    ctx.synchronize()?;
    let key = gemm::key_for(ctx, &p, &a, &b, &c)?;
    let report = gemm::search(ctx, &p, T::DTYPE, key.align)?;
    let shape = (batch, m, n, k);
    let flops = p.flops();
    // `None`: not run (rejected by the search).
    let mut push = |variant: String, t: Option<nnfuse::Result<Timing>>, note: String| {
        let (timing, note) = match t {
            Some(Ok(t)) => (Some(t), note),
            Some(Err(e)) => (None, format!("{note} error: {e}")),
            None => (None, note),
        };
        let tflops = timing.map_or(f64::NAN, |t| flops / (t.median_ms * 1e-3) / 1e12);
        rows.push(Row {
            dtype: T::DTYPE,
            shape,
            variant,
            timing,
            note,
            tflops,
        });
        tflops
    };
    let mut run_with = |algo: Algo| {
        measure(ctx, || {
            gemm::strided_batched_with(ctx, &p, &a, &b, &mut c, &algo)
        })
    };
    let default_tflops = push(
        "cuBLAS CUBLAS_GEMM_DEFAULT".into(),
        Some(run_with(Algo::CUBLAS_DEFAULT)),
        String::new(),
    );
    for algo in [
        CublasAlgo::algo(0),
        CublasAlgo::algo(5),
        CublasAlgo::algo(23),
        Some(CublasAlgo::DEFAULT_TENSOR_OP),
    ]
    .into_iter()
    .flatten()
    {
        push(
            format!("cuBLAS {}", algo.name()),
            Some(run_with(Algo::Cublas(algo))),
            String::new(),
        );
    }
    for (i, cand) in report.candidates.iter().enumerate() {
        if !matches!(cand.algo, Algo::Lt(_)) {
            continue;
        }
        let in_search = match &cand.outcome {
            Outcome::Timed { timing, .. } => format!("search: {:.2} us", timing.median_ms * 1e3),
            Outcome::Rejected(why) => format!("rejected by the search: {why}"),
        };
        let label = format!(
            "{}{}",
            if i == report.winner { "* " } else { "" },
            cand.label()
        );
        if matches!(cand.outcome, Outcome::Timed { .. }) {
            push(label, Some(run_with(cand.algo)), in_search);
        } else {
            push(label, None, in_search);
        }
    }
    let tuned = measure(ctx, || gemm::strided_batched(ctx, &p, &a, &b, &mut c));
    let tuned_tflops = push(
        "tuned (gemm::strided_batched)".into(),
        Some(tuned),
        report.choice.label(),
    );
    // Cached lookup: host time per call, many iterations.
    let iters = 1_000_000u32;
    let t = Instant::now();
    for _ in 0..iters {
        black_box(gemm::lookup(black_box(&key)));
    }
    let lookup_ns = t.elapsed().as_secs_f64() * 1e9 / iters as f64;
    Ok(ShapeSummary {
        dtype: T::DTYPE,
        shape,
        search_ms: report.wall_ms,
        lookup_ns,
        candidates: report.candidates.len(),
        rejected: report
            .candidates
            .iter()
            .filter(|c| matches!(c.outcome, Outcome::Rejected(_)))
            .count(),
        winner: report.choice.label(),
        tuned_over_default: tuned_tflops / default_tflops,
    })
}

/// The ceiling: one large bf16 GEMM (8192^3), best of the cuBLAS default and the tuned choice.
fn peak(ctx: &Context) -> nnfuse::Result<f64> {
    let n = 8192;
    let p = Problem::packed(1, n, n, n);
    let s = ctx.stream();
    let alloc = |len: usize| {
        s.alloc_zeros::<bf16>(len)
            .map_err(|e| nnfuse::Error::NotSupported(format!("{e:?}")))
    };
    let mut a = alloc(n * n)?;
    let mut b = alloc(n * n)?;
    let mut c = alloc(n * n)?;
    gemm::fill_uniform(ctx, &mut a, 1)?;
    gemm::fill_uniform(ctx, &mut b, 2)?;
    let d = measure(ctx, || {
        gemm::strided_batched_with(ctx, &p, &a, &b, &mut c, &Algo::CUBLAS_DEFAULT)
    })?;
    let t = measure(ctx, || gemm::strided_batched(ctx, &p, &a, &b, &mut c))?;
    Ok(p.flops() / (d.median_ms.min(t.median_ms) * 1e-3) / 1e12)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("NNFUSE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gemm bench: {e}");
            ExitCode::from(2)
        }
    }
}

fn run() -> nnfuse::Result<()> {
    let started = Instant::now();
    // Search on, no tuning-cache file: every shape is searched in this run.
    let ctx = Context::with_config(0, Config::default())?;
    let tag = gemm::device_tag(&ctx)?;
    println!("# GEMM benchmark on {tag}\n");
    // The process's first search compiles the search kernels (NVRTC): not a per-shape cost.
    let t = Instant::now();
    gemm::search(
        &ctx,
        &Problem::packed(1, 64, 64, 64),
        DType::F16,
        gemm::Alignment::MAX,
    )?;
    println!(
        "warm-up search (includes NVRTC compile of the search kernels): {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    let peak = peak(&ctx)?;
    println!("measured peak: bf16 8192^3 GEMM = {peak:.1} TFLOP/s (the ceiling below)\n");

    let quick = std::env::var("NNFUSE_BENCH_QUICK").is_ok_and(|v| v == "1");
    let mut shapes: Vec<(usize, usize, usize, usize)> = if quick {
        vec![(16, 512, 512, 512), (64, 128, 128, 64)]
    } else {
        vec![
            (16, 512, 512, 512),
            (16, 1024, 1024, 1024),
            (16, 2048, 2048, 2048),
            (16, 4096, 4096, 4096),
            (64, 128, 128, 64),
            (64, 1024, 1024, 64),
        ]
    };
    shapes.dedup();
    let mut rows = Vec::new();
    let mut summaries = Vec::new();
    for dt in [DType::F16, DType::BF16] {
        for &shape in &shapes {
            let r = match dt {
                DType::F16 => bench_shape::<f16>(&ctx, shape, &mut rows),
                _ => bench_shape::<bf16>(&ctx, shape, &mut rows),
            };
            match r {
                Ok(s) => summaries.push(s),
                Err(e) => eprintln!("{dt} {shape:?}: {e}"),
            }
        }
    }

    println!("| dtype | batch x m x n x k | variant | median µs | p10–p90 µs | TFLOP/s | % of peak | note |");
    println!("|---|---|---|---:|---:|---:|---:|---|");
    for r in &rows {
        let (b, m, n, k) = r.shape;
        match r.timing {
            Some(t) => println!(
                "| {} | {b} x {m} x {n} x {k} | {} | {:.2} | {:.2}–{:.2} | {:.1} | {:.1} | {} |",
                r.dtype,
                r.variant,
                t.median_ms * 1e3,
                t.p10_ms * 1e3,
                t.p90_ms * 1e3,
                r.tflops,
                100.0 * r.tflops / peak,
                r.note
            ),
            None => println!(
                "| {} | {b} x {m} x {n} x {k} | {} | – | – | – | – | {} |",
                r.dtype, r.variant, r.note
            ),
        }
    }
    println!("\n| dtype | batch x m x n x k | search ms | cached lookup ns | candidates | rejected | tuned / default | winner |");
    println!("|---|---|---:|---:|---:|---:|---:|---|");
    for s in &summaries {
        let (b, m, n, k) = s.shape;
        println!(
            "| {} | {b} x {m} x {n} x {k} | {:.1} | {:.0} | {} | {} | {:.3} | {} |",
            s.dtype,
            s.search_ms,
            s.lookup_ns,
            s.candidates,
            s.rejected,
            s.tuned_over_default,
            s.winner
        );
    }
    println!();
    println!(
        "{}",
        json!({"bench": "gemm", "kind": "peak", "dtype": "bf16", "m": 8192, "n": 8192, "k": 8192,
               "tflops": peak, "device": tag.name})
    );
    for r in &rows {
        let (b, m, n, k) = r.shape;
        println!(
            "{}",
            json!({
                "bench": "gemm", "kind": "variant", "dtype": r.dtype.name(),
                "batch": b, "m": m, "n": n, "k": k, "variant": r.variant,
                "median_us": r.timing.map(|t| t.median_ms * 1e3),
                "p10_us": r.timing.map(|t| t.p10_ms * 1e3),
                "p90_us": r.timing.map(|t| t.p90_ms * 1e3),
                "tflops": r.timing.map(|_| r.tflops),
                "pct_peak": r.timing.map(|_| 100.0 * r.tflops / peak),
                "note": r.note,
            })
        );
    }
    for s in &summaries {
        let (b, m, n, k) = s.shape;
        println!(
            "{}",
            json!({
                "bench": "gemm", "kind": "search", "dtype": s.dtype.name(),
                "batch": b, "m": m, "n": n, "k": k, "search_ms": s.search_ms,
                "cached_lookup_ns": s.lookup_ns, "candidates": s.candidates,
                "rejected": s.rejected, "tuned_over_default": s.tuned_over_default,
                "winner": s.winner,
            })
        );
    }
    eprintln!("gemm bench: {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}
