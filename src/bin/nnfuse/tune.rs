//! `nnfuse tune --gemm b,m,n,k --dtype f16 [--trans-a] [--trans-b] [--compute f32|f16]
//! [--own-buffers]`: runs the GEMM algorithm search for one packed problem, prints every
//! candidate's time and TFLOP/s and the winner, and stores the result in the tuning cache (the
//! file named by `NNFUSE_TUNING_CACHE`, when set).
//!
//! By default the search runs on its own pseudo-random operands, in scratch memory that this one
//! search allocates (A, B and two C's), as `gemm::search` does. With `--own-buffers`, nnfuse tune
//! first allocates A, B and C as an application would (A and B pseudo-random, C zero, or
//! pseudo-random when beta != 0), reports that apart, and searches on them as the first
//! `gemm::strided_batched` call of the shape does (`gemm::search_on`: scratch for C only).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
use half::{bf16, f16};
use indicatif::{ProgressBar, ProgressStyle};
use nnfuse::gemm::{
    self, Alignment, Compute, Outcome, Problem, SearchProgress, SearchReport, Validated,
};
use nnfuse::{Config, Context, DType, Element};

/// Arguments of `nnfuse tune`.
#[derive(Args, Debug)]
pub struct TuneArgs {
    /// The strided batched GEMM to tune, as `batch,m,n,k` (packed, column-major).
    #[arg(long, value_name = "B,M,N,K", allow_hyphen_values = true)]
    gemm: String,
    /// Element type of A, B and C: f32, f16 or bf16.
    #[arg(long, default_value = "f16")]
    dtype: String,
    /// op(A) = A^T.
    #[arg(long)]
    trans_a: bool,
    /// op(B) = B^T.
    #[arg(long)]
    trans_b: bool,
    /// Accumulation type: f32, or f16 (f16 data only).
    #[arg(long, default_value = "f32")]
    compute: String,
    /// Scale of the product.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    alpha: f32,
    /// Scale of the old C (0: C is not read).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    beta: f32,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = crate::non_negative::<usize>)]
    device: usize,
    /// Search on operand buffers allocated (and filled) first, as an application's first call
    /// does, instead of on the search's own scratch operands.
    #[arg(long)]
    own_buffers: bool,
}

/// Allocates and fills A, B and C for `p` (reported apart: an application has them already),
/// then searches on them. Returns the report and the milliseconds the buffers took.
fn search_on_own_buffers<T: Element>(
    ctx: &Context,
    p: &Problem,
    progress: &mut dyn FnMut(SearchProgress<'_>),
) -> anyhow::Result<(SearchReport, f64)> {
    let spans = match p.check(T::DTYPE)? {
        Validated::Spans(s) => s,
        Validated::Empty => bail!("the problem is empty (m, n or batch is 0)"),
    };
    let t = Instant::now();
    let s = ctx.stream();
    let alloc = |n: usize| {
        s.alloc_zeros::<T>(n)
            .map_err(|e| anyhow::anyhow!("allocating {n} elements: {e:?}"))
    };
    let mut a = alloc(spans.a)?;
    let mut b = alloc(spans.b)?;
    let mut c = alloc(spans.c)?;
    nnfuse::internals::gemm::fill_uniform(ctx, &mut a, 1)?;
    nnfuse::internals::gemm::fill_uniform(ctx, &mut b, 2)?;
    if p.beta != 0.0 {
        nnfuse::internals::gemm::fill_uniform(ctx, &mut c, 3)?;
    }
    ctx.synchronize()?;
    let buffers_ms = t.elapsed().as_secs_f64() * 1e3;
    let r = gemm::search_on_with(ctx, p, &a, &b, &mut c, progress)?;
    Ok((r, buffers_ms))
}

fn parse_shape(s: &str) -> anyhow::Result<[usize; 4]> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    if parts.len() != 4 {
        bail!("--gemm {s:?}: expected batch,m,n,k (four comma-separated numbers)");
    }
    let mut v = [0usize; 4];
    for ((slot, p), name) in v.iter_mut().zip(&parts).zip(["batch", "m", "n", "k"]) {
        *slot =
            crate::non_negative(p).map_err(|why| anyhow::anyhow!("--gemm {s:?}: {name}: {why}"))?;
    }
    Ok(v)
}

/// The problem the flags describe, checked as the search will check it — before any GPU is
/// looked for. Errors name the flag the user typed.
fn problem(args: &TuneArgs) -> anyhow::Result<(Problem, DType)> {
    let [batch, m, n, k] = parse_shape(&args.gemm)?;
    let dtype: DType = args
        .dtype
        .parse()
        .map_err(|_| anyhow::anyhow!("--dtype {:?}: not one of f32, f16, bf16", args.dtype))?;
    let compute: Compute = args
        .compute
        .parse()
        .map_err(|_| anyhow::anyhow!("--compute {:?}: not one of f32, f16", args.compute))?;
    let p = Problem::packed_trans(batch, m, n, k, args.trans_a, args.trans_b)
        .with_compute(compute)
        .with_scalars(args.alpha, args.beta);
    match p.check(dtype) {
        Ok(Validated::Spans(_)) => Ok((p, dtype)),
        Ok(Validated::Empty) => {
            bail!(
                "--gemm {:?}: the problem is empty (batch, m or n is 0): nothing to search",
                args.gemm
            )
        }
        Err(e) => {
            let flag = match e.argument() {
                Some("compute") => "--compute".to_string(),
                Some(a @ ("alpha" | "beta")) => format!("--{a}"),
                Some(a) => format!("--gemm {:?} ({a})", args.gemm),
                None => "--gemm".to_string(),
            };
            Err(anyhow::Error::new(e).context(flag))
        }
    }
}

/// Runs the search and prints the report.
pub fn run(args: TuneArgs) -> anyhow::Result<ExitCode> {
    let (p, dtype) = problem(&args)?;
    let config = Config::from_env_once()?;
    let ctx = Context::with_config(args.device, config.clone())?;
    let tag = nnfuse::internals::gemm::device_tag(&ctx)?;

    let bar = ProgressBar::new(1);
    if let Ok(style) =
        ProgressStyle::with_template("{spinner} [{bar:30}] {pos}/{len} {elapsed} {wide_msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.enable_steady_tick(Duration::from_millis(100));
    let mut on_progress = |s: SearchProgress<'_>| {
        bar.set_length(s.total as u64);
        bar.set_position(s.done as u64);
        bar.set_message(s.label.to_string());
    };
    let result = if args.own_buffers {
        match dtype {
            DType::F32 => search_on_own_buffers::<f32>(&ctx, &p, &mut on_progress),
            DType::F16 => search_on_own_buffers::<f16>(&ctx, &p, &mut on_progress),
            DType::BF16 => search_on_own_buffers::<bf16>(&ctx, &p, &mut on_progress),
        }
        .map(|(r, ms)| (r, Some(ms)))
    } else {
        gemm::search_with(&ctx, &p, dtype, Alignment::MAX, &mut on_progress)
            .map(|r| (r, None))
            .map_err(Into::into)
    };
    bar.finish_and_clear();
    let (r, buffers_ms) = result?;

    let tflops = |ms: f64| p.flops() / (ms * 1e-3) / 1e12;
    println!("nnfuse tune: {} on {tag}", r.key);
    let ph = &r.phases;
    println!(
        "search: {:.1} ms (prepare {:.1} [candidates {:.1}, scratch allocation {:.1}], check \
         {:.1}, timing {:.1}); one-off setup before it: {:.1} ms (NVRTC compile of the search \
         kernels, cuBLAS/cuBLASLt handles, workspace; cuBLASLt's first heuristic query {:.1} ms)",
        r.wall_ms,
        ph.prepare_ms,
        ph.candidates_ms,
        ph.alloc_ms,
        ph.check_ms,
        ph.timing_ms,
        r.setup_ms,
        r.setup_first_query_ms
    );
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    if let Some(ms) = buffers_ms {
        println!(
            "--own-buffers: A, B and C ({:.1} MiB) allocated and filled by nnfuse tune in {ms:.1} \
             ms before the search (not part of it: an application has its buffers already)",
            mib(p.check(dtype).ok().map_or(0, |v| match v {
                Validated::Spans(s) => (s.a + s.b + s.c) * dtype.size(),
                Validated::Empty => 0,
            }))
        );
    }
    println!(
        "operands: {}; {:.1} MiB of scratch ({})",
        r.operands,
        mib(r.scratch_bytes),
        if r.allocated_bytes > 0 {
            format!(
                "allocated {:.1} MiB: the process's first search of this size",
                mib(r.allocated_bytes)
            )
        } else {
            "reused".into()
        }
    );
    println!(
        "{} candidates; results compared with the cuBLAS default at relative L2 {:.1e}; timed \
         interleaved (round-robin) over {} rounds{}",
        r.candidates.len(),
        r.tolerance,
        r.rounds,
        if r.explicit_cublas {
            "; explicit cublasGemmAlgo_t values searched (pre-sm_80 GPU)"
        } else {
            "; explicit cublasGemmAlgo_t values not searched (ignored by cuBLAS on sm_80+)"
        }
    );
    if let Some(note) = &r.lt_note {
        println!("cuBLASLt: {note}");
    }
    println!(
        "{:>3}  {:<78} {:>11} {:>9} {:>9} {:>15} {:>6}  status",
        "#", "candidate", "median us", "TFLOP/s", "vs dflt", "p10-p90 vs dflt", "GEMMs"
    );
    for (i, c) in r.candidates.iter().enumerate() {
        let mark = if i == r.winner { "*" } else { " " };
        match &c.outcome {
            Outcome::Timed {
                timing,
                rel_diff,
                burst,
                vs_default,
            } => {
                let ms = timing.median_ms;
                // Speed-ups from the per-round time ratios (drift-free), > 1: faster.
                let (vs, lo, hi) = vs_default.map_or((f64::NAN, f64::NAN, f64::NAN), |v| {
                    (1.0 / v.median, 1.0 / v.p90, 1.0 / v.p10)
                });
                println!(
                    "{mark}{i:>2}  {:<78} {:>11.2} {:>9.1} {:>8.3}x {:>7.3}-{:<7.3} {:>6}  ok (p10 {:.2} p90 {:.2} us, diff {:.1e})",
                    c.label(),
                    ms * 1e3,
                    tflops(ms),
                    vs,
                    lo,
                    hi,
                    burst,
                    timing.p10_ms * 1e3,
                    timing.p90_ms * 1e3,
                    rel_diff
                );
            }
            Outcome::Rejected(why) => {
                println!(
                    "{mark}{i:>2}  {:<78} {:>11} {:>9} {:>9} {:>15} {:>6}  rejected: {why}",
                    c.label(),
                    "-",
                    "-",
                    "-",
                    "-",
                    "-"
                );
            }
        }
    }
    println!(
        "rule: the cuBLAS default is kept unless a candidate is at least {:.0}% faster in the \
         median round and faster in ~90% of rounds (all rounds up to 6)",
        nnfuse::internals::gemm::KEEP_DEFAULT_MARGIN * 100.0
    );
    let speedup = match r.candidates.get(r.winner).and_then(|c| c.vs_default()) {
        Some(v) if r.winner != 0 => format!("{:.3}x the cuBLAS default", 1.0 / v.median),
        _ => "the cuBLAS default itself".into(),
    };
    println!("winner: #{} {} ({speedup})", r.winner, r.choice.label());
    match &config.tuning_cache {
        Some(path) => {
            let stored = nnfuse::internals::gemm::load_file(path, &tag, r.key.device)
                .entries
                .iter()
                .any(|(k, c)| *k == r.key && c.algo == r.choice.algo);
            if stored {
                println!("stored in {}", path.display());
            } else {
                println!(
                    "NOT stored in {} (see the warning above); the result only lived in this process",
                    path.display()
                );
                return Ok(ExitCode::from(1));
            }
        }
        None => println!(
            "not persisted: set NNFUSE_TUNING_CACHE=<file> to keep the result for later processes"
        ),
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse() {
        assert_eq!(
            parse_shape("16, 4096,4096,64").unwrap(),
            [16, 4096, 4096, 64]
        );
        assert!(parse_shape("16,4096,4096").is_err());
        assert!(parse_shape("16,4096,-1,4").is_err());
    }
}
