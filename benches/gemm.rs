//! Strided batched GEMM benchmark: for each shape and type, the cuBLAS default, a few explicit
//! `cublasGemmAlgo_t` values (to show on the record whether they change anything on this GPU),
//! every cuBLASLt candidate of the search (descriptors built once, as the tuned path caches
//! them), and the tuned call `gemm::strided_batched` exactly as a user makes it, in TFLOP/s
//! against the measured peak of a large bf16 GEMM in the same run; plus the cost of the search
//! per shape (apart from the one-off setup), of a cached lookup, and the host time per call.
//!
//! All variants of a shape are timed **interleaved** (`nnfuse::internals::timing::time_interleaved_gpu`):
//! round-robin, a sample being a burst of back-to-back calls worth at least 0.2 ms of GPU time
//! queued behind a head start of GPU work (GPU time only: a small GEMM's call costs the host more
//! than its kernel runs), so that clock and thermal drift hits every variant alike; "vs default" columns are medians of
//! per-round time ratios, which cancel the drift. Prints markdown tables, a summary (how often
//! tuned is slower than the default, how often the heuristic's first cuBLASLt candidate is the
//! fastest and by how much it is not), then JSON lines.
//!
//! Floor per shape: the larger of its FLOPs over the measured peak and its bytes (A and B read
//! once, C written once) over the copy bandwidth measured in the same run; the skinny shapes
//! (few output tiles, a long K: a classifier at batch 32, a 1x1 convolution's filter gradient)
//! are bandwidth-bound, and they are where the search's split-K variants matter.
//!
//! `cargo bench --bench gemm` (on a GPU). `NNFUSE_BENCH_QUICK=1` runs two small shapes only;
//! `NNFUSE_BENCH_GEMM=skinny` the skinny shapes only.

#[path = "support/exit.rs"]
mod exit;

use std::hint::black_box;
use std::process::ExitCode;
use std::time::Instant;

use half::{bf16, f16};
use nnfuse::gemm::{self, Algo, CublasAlgo, Outcome, Prepared, Problem};
use nnfuse::internals::timing::{
    copy_bandwidth, time_interleaved_gpu, time_interleaved_gpu_cold, Interleaved,
    InterleavedOptions, Paired, Timing,
};
use nnfuse::{Config, Context, DType, Element};
use serde_json::json;

/// How every shape is measured.
const OPTS: InterleavedOptions = InterleavedOptions {
    warmup_rounds: 2,
    min_sample_ms: 0.2,
    max_burst: 512,
    min_rounds: 10,
    max_rounds: 60,
    budget_ms: 600.0,
};

/// A tuned call counts as slower than the default when its median per-round time ratio exceeds
/// this and it was slower in at least 90 % of the rounds (p10 of the ratios above 1).
const SLOWER_MARGIN: f64 = 1.01;

/// One measured variant of one shape.
struct Row {
    dtype: DType,
    shape: (usize, usize, usize, usize),
    variant: String,
    timing: Option<Timing>,
    /// Per-round time ratio to the cuBLAS default.
    vs_default: Option<Paired>,
    burst: usize,
    note: String,
    tflops: f64,
}

struct ShapeSummary {
    dtype: DType,
    shape: (usize, usize, usize, usize),
    search_ms: f64,
    setup_ms: f64,
    lookup_ns: f64,
    host_us_default: f64,
    host_us_tuned: f64,
    candidates: usize,
    rejected: usize,
    rounds: usize,
    winner: String,
    /// Tuned time / default time, per round.
    tuned_vs_default: Option<Paired>,
    /// Label of the fastest of the default and the cuBLASLt candidates (bench medians).
    fastest: String,
    /// Whether the heuristic's first cuBLASLt candidate was the fastest searched kernel: no other
    /// (default included) beat it by the search's rule (`nnfuse::internals::gemm::beats_default`).
    heuristic_first_fastest: Option<bool>,
    /// The best other searched kernel's time / heuristic #0's time, per round (the lowest
    /// median; below 0.98 and consistent: #0 was not the fastest).
    fastest_vs_heuristic_first: Option<Paired>,
    /// Tuned time / heuristic #0 time, per round.
    tuned_vs_heuristic_first: Option<Paired>,
}

fn err(e: impl std::fmt::Debug) -> nnfuse::Error {
    nnfuse::Error::NotSupported(format!("{e:?}"))
}

/// Host time (µs) of queuing one call, averaged over 100 calls queued back to back (fewer than
/// the launch queue holds, so the host never waits for the GPU).
fn host_us(ctx: &Context, mut f: impl FnMut() -> nnfuse::Result<()>) -> nnfuse::Result<f64> {
    ctx.synchronize()?;
    let n = 100;
    let t = Instant::now();
    for _ in 0..n {
        f()?;
    }
    let us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
    ctx.synchronize()?;
    Ok(us)
}

enum Kind {
    Prepared(Box<Prepared>),
    Tuned,
}

fn bench_shape<T: Element>(
    ctx: &Context,
    (batch, m, n, k): (usize, usize, usize, usize),
    rows: &mut Vec<Row>,
) -> nnfuse::Result<ShapeSummary> {
    let p = Problem::packed(batch, m, n, k);
    let s = ctx.stream();
    let mut a = s.alloc_zeros::<T>(batch * m * k).map_err(err)?;
    let mut b = s.alloc_zeros::<T>(batch * k * n).map_err(err)?;
    let mut c = s.alloc_zeros::<T>(batch * m * n).map_err(err)?;
    nnfuse::internals::gemm::fill_uniform(ctx, &mut a, 1)?;
    nnfuse::internals::gemm::fill_uniform(ctx, &mut b, 2)?;
    ctx.synchronize()?;
    let key = gemm::key_for(ctx, &p, &a, &b, &c)?;
    let report = gemm::search(ctx, &p, T::DTYPE, key.align)?;
    let shape = (batch, m, n, k);
    let flops = p.flops();

    // The variants: (label, note, how to run, heuristic rank).
    let mut variants: Vec<(String, String, Kind, Option<usize>)> = Vec::new();
    let prepare = |algo: Algo| Prepared::new(ctx, &p, T::DTYPE, &algo, key.align);
    variants.push((
        "cuBLAS CUBLAS_GEMM_DEFAULT".into(),
        String::new(),
        Kind::Prepared(Box::new(prepare(Algo::CUBLAS_DEFAULT)?)),
        None,
    ));
    for algo in [
        CublasAlgo::algo(0),
        CublasAlgo::algo(5),
        CublasAlgo::algo(23),
        Some(CublasAlgo::DEFAULT_TENSOR_OP),
    ]
    .into_iter()
    .flatten()
    {
        variants.push((
            format!("cuBLAS {}", algo.name()),
            String::new(),
            Kind::Prepared(Box::new(prepare(Algo::Cublas(algo))?)),
            None,
        ));
    }
    let mut not_run = Vec::new();
    for (i, cand) in report.candidates.iter().enumerate() {
        if !matches!(cand.algo, Algo::Lt(_)) {
            continue;
        }
        let label = format!(
            "{}{}",
            if i == report.winner { "* " } else { "" },
            cand.label()
        );
        match &cand.outcome {
            Outcome::Timed {
                timing, vs_default, ..
            } => {
                let note = format!(
                    "search: {:.2} us, {}",
                    timing.median_ms * 1e3,
                    vs_default.map_or_else(|| "-".into(), |v| format!("{:.3}x default", v.median))
                );
                match prepare(cand.algo) {
                    Ok(pr) => variants.push((
                        label,
                        note,
                        Kind::Prepared(Box::new(pr)),
                        cand.heuristic_rank,
                    )),
                    Err(e) => not_run.push((label, format!("{note}; not prepared: {e}"))),
                }
            }
            Outcome::Rejected(why) => {
                not_run.push((label, format!("rejected by the search: {why}")))
            }
        }
    }
    variants.push((
        "tuned (gemm::strided_batched)".into(),
        report.choice.label(),
        Kind::Tuned,
        None,
    ));
    let tuned_idx = variants.len() - 1;

    let l2 = ctx.info().l2_bytes.max(0) as usize;
    let cold = nnfuse::internals::gemm::cold_flush_bytes(
        &gemm::Spans {
            a: batch * m * k,
            b: batch * k * n,
            c: batch * m * n,
        },
        T::DTYPE.size(),
        l2,
    );
    let n_var = variants.len();
    let launch = |v: usize, _| match &variants[v].2 {
        Kind::Prepared(pr) => pr.run(ctx, &a, &b, &mut c),
        Kind::Tuned => gemm::strided_batched(ctx, &p, &a, &b, &mut c),
    };
    // Cold where the operands fit in L2, as the search times them; larger shapes on GPU time
    // behind head starts (the search times those back to back: their kernels outlast their
    // calls' host time, so the two agree).
    let res: Interleaved = match cold {
        Some(flush) => time_interleaved_gpu_cold(ctx, OPTS, n_var, flush, launch)?,
        None => time_interleaved_gpu(ctx, OPTS, n_var, launch)?,
    };
    let tflops_of = |t: &Timing| flops / (t.median_ms * 1e-3) / 1e12;
    for (v, (label, note, _, _)) in variants.iter().enumerate() {
        let timing = res.timing(v);
        let note = match &res.errors[v] {
            Some(e) => format!("{note} error: {e}"),
            None => note.clone(),
        };
        rows.push(Row {
            dtype: T::DTYPE,
            shape,
            variant: label.clone(),
            timing,
            vs_default: res.paired(0, v),
            burst: res.bursts[v],
            note,
            tflops: timing.as_ref().map_or(f64::NAN, tflops_of),
        });
    }
    for (label, note) in not_run {
        rows.push(Row {
            dtype: T::DTYPE,
            shape,
            variant: label,
            timing: None,
            vs_default: None,
            burst: 0,
            note,
            tflops: f64::NAN,
        });
    }

    // The heuristic's first cuBLASLt candidate against every other searched kernel (the default
    // and the other cuBLASLt candidates), per round. #0 counts as the fastest unless one of them
    // beats it by the search's own rule (more than 2 % in the median round, faster in ~90 % of
    // rounds), so that equal kernels do not flip the verdict on noise.
    let median = |v: usize| res.timing(v).map(|t| t.median_ms);
    let searched: Vec<usize> = std::iter::once(0)
        .chain((0..variants.len()).filter(|&v| variants[v].3.is_some()))
        .filter(|&v| median(v).is_some())
        .collect();
    let fastest = searched.iter().copied().min_by(|x, y| {
        median(*x)
            .unwrap_or(f64::MAX)
            .total_cmp(&median(*y).unwrap_or(f64::MAX))
    });
    let first = (0..variants.len()).find(|&v| variants[v].3 == Some(0) && median(v).is_some());
    let best_vs_first: Option<Paired> = first.and_then(|f| {
        searched
            .iter()
            .filter(|&&v| v != f)
            .filter_map(|&v| res.paired(f, v))
            .min_by(|x, y| x.median.total_cmp(&y.median))
    });
    // Cached lookup: host time per call, many iterations.
    let iters = 1_000_000u32;
    let t = Instant::now();
    for _ in 0..iters {
        black_box(gemm::lookup(black_box(&key)));
    }
    let lookup_ns = t.elapsed().as_secs_f64() * 1e9 / iters as f64;
    let host_us_default = match &variants[0].2 {
        Kind::Prepared(pr) => host_us(ctx, || pr.run(ctx, &a, &b, &mut c))?,
        Kind::Tuned => f64::NAN,
    };
    let host_us_tuned = host_us(ctx, || gemm::strided_batched(ctx, &p, &a, &b, &mut c))?;

    Ok(ShapeSummary {
        dtype: T::DTYPE,
        shape,
        search_ms: report.wall_ms,
        setup_ms: report.setup_ms,
        lookup_ns,
        host_us_default,
        host_us_tuned,
        candidates: report.candidates.len(),
        rejected: report
            .candidates
            .iter()
            .filter(|c| matches!(c.outcome, Outcome::Rejected(_)))
            .count(),
        rounds: res.rounds,
        winner: report.choice.label(),
        tuned_vs_default: res.paired(0, tuned_idx),
        fastest: fastest.map_or_else(|| "-".into(), |v| variants[v].0.clone()),
        heuristic_first_fastest: first
            .map(|_| !best_vs_first.is_some_and(|p| nnfuse::internals::gemm::beats_default(&p))),
        fastest_vs_heuristic_first: best_vs_first,
        tuned_vs_heuristic_first: first.and_then(|f| res.paired(f, tuned_idx)),
    })
}

/// The ceiling: one large bf16 GEMM (8192^3), the faster of the cuBLAS default and the tuned
/// call, timed interleaved.
fn peak(ctx: &Context) -> nnfuse::Result<f64> {
    let n = 8192;
    let p = Problem::packed(1, n, n, n);
    let s = ctx.stream();
    let mut a = s.alloc_zeros::<bf16>(n * n).map_err(err)?;
    let mut b = s.alloc_zeros::<bf16>(n * n).map_err(err)?;
    let mut c = s.alloc_zeros::<bf16>(n * n).map_err(err)?;
    nnfuse::internals::gemm::fill_uniform(ctx, &mut a, 1)?;
    nnfuse::internals::gemm::fill_uniform(ctx, &mut b, 2)?;
    // The first tuned call searches; not timed.
    gemm::strided_batched(ctx, &p, &a, &b, &mut c)?;
    let default = Prepared::new(
        ctx,
        &p,
        DType::BF16,
        &Algo::CUBLAS_DEFAULT,
        gemm::Alignment::MAX,
    )?;
    let opts = InterleavedOptions {
        budget_ms: 300.0,
        ..OPTS
    };
    let res = time_interleaved_gpu(ctx, opts, 2, |v, _| {
        if v == 0 {
            default.run(ctx, &a, &b, &mut c)
        } else {
            gemm::strided_batched(ctx, &p, &a, &b, &mut c)
        }
    })?;
    let best = (0..2)
        .filter_map(|v| res.timing(v).map(|t| t.median_ms))
        .fold(f64::INFINITY, f64::min);
    Ok(p.flops() / (best * 1e-3) / 1e12)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("NNFUSE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    exit::finish("gemm", run().map_err(Into::into))
}

/// The shape's floor (µs): FLOPs over `peak` (TFLOP/s) or A, B and C's bytes over `bw`
/// (bytes/s), whichever is longer.
fn floor_us(dtype: DType, (b, m, n, k): (usize, usize, usize, usize), peak: f64, bw: f64) -> f64 {
    let flops = 2.0 * (b * m * n * k) as f64;
    let bytes = (b * (m * k + k * n + m * n) * dtype.size()) as f64;
    (flops / (peak * 1e12)).max(bytes / bw) * 1e6
}

fn fmt_paired(p: &Option<Paired>) -> String {
    p.map_or_else(
        || "–".into(),
        |p| format!("{:.3} ({:.3}–{:.3})", p.median, p.p10, p.p90),
    )
}

fn run() -> nnfuse::Result<()> {
    let started = Instant::now();
    // Search on, no tuning-cache file: every shape is searched in this run.
    let ctx = Context::with_config(0, Config::default())?;
    let tag = nnfuse::internals::gemm::device_tag(&ctx)?;
    println!("# GEMM benchmark on {tag}\n");
    // The process's first search pays the one-off setup (NVRTC compile of the search kernels,
    // handles, workspace); the report separates it from the search's own cost.
    let first = gemm::search(
        &ctx,
        &Problem::packed(1, 64, 64, 64),
        DType::F16,
        gemm::Alignment::MAX,
    )?;
    println!(
        "first search of the process: one-off setup {:.1} ms (NVRTC compile of the search kernels, \
         handles, workspace), then the search itself {:.1} ms",
        first.setup_ms, first.wall_ms
    );
    let peak = peak(&ctx)?;
    println!("measured peak: bf16 8192^3 GEMM = {peak:.1} TFLOP/s (the ceiling below)");
    let bw = copy_bandwidth(&ctx, 1 << 30)?;
    println!(
        "measured copy bandwidth: {:.2} TB/s (bytes read + written)\n",
        bw / 1e12
    );
    println!(
        "Every variant of a shape is timed interleaved ({}–{} rounds, round-robin, samples of >= \
         {} ms of back-to-back calls behind a head start: GPU time only; cold, one call per sample behind a write of twice the L2, where A, B and C fit in L2, as the search times them). \"vs default\": median per-round time ratio to the cuBLAS \
         default (p10–p90); below 1 is faster.\n",
        OPTS.min_rounds, OPTS.max_rounds, OPTS.min_sample_ms
    );

    let quick = std::env::var("NNFUSE_BENCH_QUICK").is_ok_and(|v| v == "1");
    let skinny_only = std::env::var("NNFUSE_BENCH_GEMM").is_ok_and(|v| v == "skinny");
    // Few output tiles, long K: the demo's classifier forward and data gradient (batch 32), a
    // 1x1 convolution's filter gradient at 56x56 batch 32 (64 x 256 over 100352 rows).
    let skinny = [
        (1, 1000, 32, 2048),
        (1, 2048, 32, 1000),
        (1, 64, 256, 100352),
    ];
    let shapes: Vec<(usize, usize, usize, usize)> = if quick {
        vec![(16, 512, 512, 512), (64, 128, 128, 64)]
    } else if skinny_only {
        skinny.to_vec()
    } else {
        vec![
            (16, 512, 512, 512),
            (16, 1024, 1024, 1024),
            (16, 2048, 2048, 2048),
            (16, 4096, 4096, 4096),
            (64, 128, 128, 64),
            (64, 1024, 1024, 64),
        ]
        .into_iter()
        .chain(skinny)
        .collect()
    };
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

    println!("| dtype | batch x m x n x k | variant | median µs | floor µs | p10–p90 µs | TFLOP/s | % of peak | vs default | calls/sample | note |");
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|");
    for r in &rows {
        let (b, m, n, k) = r.shape;
        let floor = floor_us(r.dtype, r.shape, peak, bw);
        match r.timing {
            Some(t) => println!(
                "| {} | {b} x {m} x {n} x {k} | {} | {:.2} | {floor:.2} | {:.2}–{:.2} | {:.1} | {:.1} | {} | {} | {} |",
                r.dtype,
                r.variant,
                t.median_ms * 1e3,
                t.p10_ms * 1e3,
                t.p90_ms * 1e3,
                r.tflops,
                100.0 * r.tflops / peak,
                fmt_paired(&r.vs_default),
                r.burst,
                r.note
            ),
            None => println!(
                "| {} | {b} x {m} x {n} x {k} | {} | – | {floor:.2} | – | – | – | – | – | {} |",
                r.dtype, r.variant, r.note
            ),
        }
    }
    println!("\n| dtype | batch x m x n x k | search ms | cached lookup ns | host µs/call default | host µs/call tuned | candidates | rejected | rounds | tuned / default time | winner | fastest searched kernel | heuristic #0 fastest? | best other / #0 time | tuned / #0 time |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|---:|");
    for s in &summaries {
        let (b, m, n, k) = s.shape;
        println!(
            "| {} | {b} x {m} x {n} x {k} | {:.1} | {:.0} | {:.2} | {:.2} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            s.dtype,
            s.search_ms,
            s.lookup_ns,
            s.host_us_default,
            s.host_us_tuned,
            s.candidates,
            s.rejected,
            s.rounds,
            fmt_paired(&s.tuned_vs_default),
            s.winner,
            s.fastest,
            s.heuristic_first_fastest
                .map_or("–", |f| if f { "yes" } else { "no" }),
            fmt_paired(&s.fastest_vs_heuristic_first),
            fmt_paired(&s.tuned_vs_heuristic_first),
        );
    }

    // Summary against the targets.
    let total = summaries.len();
    let slower: Vec<String> = summaries
        .iter()
        .filter(|s| {
            s.tuned_vs_default
                .is_some_and(|p| p.median > SLOWER_MARGIN && p.p10 > 1.0)
        })
        .map(|s| format!("{} {:?}", s.dtype, s.shape))
        .collect();
    let faster: Vec<String> = summaries
        .iter()
        .filter_map(|s| {
            s.tuned_vs_default
                .filter(|p| p.median < 1.0 - nnfuse::internals::gemm::KEEP_DEFAULT_MARGIN)
                .map(|p| {
                    format!(
                        "{} {:?} ({:.1}% faster)",
                        s.dtype,
                        s.shape,
                        100.0 * (1.0 / p.median - 1.0)
                    )
                })
        })
        .collect();
    let heur_known: Vec<&ShapeSummary> = summaries
        .iter()
        .filter(|s| s.heuristic_first_fastest.is_some())
        .collect();
    let heur_not: Vec<String> = heur_known
        .iter()
        .filter(|s| s.heuristic_first_fastest == Some(false))
        .map(|s| {
            format!(
                "{} {:?}: the best other kernel {:.1}% faster than #0, tuned {:.1}% faster than #0",
                s.dtype,
                s.shape,
                s.fastest_vs_heuristic_first
                    .map_or(f64::NAN, |p| 100.0 * (1.0 / p.median - 1.0)),
                s.tuned_vs_heuristic_first
                    .map_or(f64::NAN, |p| 100.0 * (1.0 / p.median - 1.0)),
            )
        })
        .collect();
    println!("\n## Summary");
    println!(
        "- tuned slower than the cuBLAS default (median per-round time ratio > {SLOWER_MARGIN} and \
         slower in >= 90% of rounds): {} of {total} shapes{}",
        slower.len(),
        if slower.is_empty() {
            String::new()
        } else {
            format!(": {}", slower.join("; "))
        }
    );
    println!(
        "- tuned faster than the default by more than {:.0}%: {} of {total} shapes{}",
        nnfuse::internals::gemm::KEEP_DEFAULT_MARGIN * 100.0,
        faster.len(),
        if faster.is_empty() {
            String::new()
        } else {
            format!(": {}", faster.join("; "))
        }
    );
    println!(
        "- the heuristic's first cuBLASLt candidate was the fastest searched kernel (none of the \
         default and the other candidates beat it by > {:.0}% in nearly every round) in {} of {} \
         shapes{}",
        nnfuse::internals::gemm::KEEP_DEFAULT_MARGIN * 100.0,
        heur_known.len() - heur_not.len(),
        heur_known.len(),
        if heur_not.is_empty() {
            String::new()
        } else {
            format!("; where not: {}", heur_not.join("; "))
        }
    );
    println!();
    println!(
        "{}",
        json!({"bench": "gemm", "kind": "peak", "dtype": "bf16", "m": 8192, "n": 8192, "k": 8192,
               "tflops": peak, "device": tag.name})
    );
    let pj = |p: &Option<Paired>| {
        p.map(|p| {
            json!({"median": p.median, "p10": p.p10, "p90": p.p90,
                         "faster_rounds": p.faster_rounds, "rounds": p.rounds})
        })
    };
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
                "floor_us": floor_us(r.dtype, r.shape, peak, bw),
                "time_vs_default": pj(&r.vs_default),
                "calls_per_sample": r.burst,
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
                "setup_ms": s.setup_ms,
                "cached_lookup_ns": s.lookup_ns,
                "host_us_per_call_default": s.host_us_default,
                "host_us_per_call_tuned": s.host_us_tuned,
                "candidates": s.candidates, "rejected": s.rejected, "rounds": s.rounds,
                "tuned_over_default": s.tuned_vs_default.map(|p| 1.0 / p.median),
                "tuned_time_vs_default": pj(&s.tuned_vs_default),
                "winner": s.winner,
                "fastest": s.fastest,
                "heuristic_first_fastest": s.heuristic_first_fastest,
                "fastest_time_vs_heuristic_first": pj(&s.fastest_vs_heuristic_first),
                "tuned_time_vs_heuristic_first": pj(&s.tuned_vs_heuristic_first),
            })
        );
    }
    eprintln!("gemm bench: {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}
