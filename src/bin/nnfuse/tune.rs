//! `nnfuse tune --gemm b,m,n,k --dtype f16 [--trans-a] [--trans-b] [--compute f32|f16]`: runs
//! the GEMM algorithm search for one packed problem (on the search's own pseudo-random inputs,
//! in scratch memory that this one search allocates),
//! prints every candidate's time and TFLOP/s and the winner, and stores the result in the tuning
//! cache (the file named by `NNFUSE_TUNING_CACHE`, when set).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use nnfuse::gemm::{self, Alignment, Compute, Outcome, Problem, SearchProgress};
use nnfuse::{Config, Context, DType};

/// Arguments of `nnfuse tune`.
#[derive(Args, Debug)]
pub struct TuneArgs {
    /// The strided batched GEMM to tune, as `batch,m,n,k` (packed, column-major).
    #[arg(long, value_name = "B,M,N,K")]
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
    #[arg(long, default_value_t = 1.0)]
    alpha: f32,
    /// Scale of the old C (0: C is not read).
    #[arg(long, default_value_t = 0.0)]
    beta: f32,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
}

fn parse_shape(s: &str) -> anyhow::Result<[usize; 4]> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    if parts.len() != 4 {
        bail!("--gemm {s:?}: expected batch,m,n,k (four comma-separated numbers)");
    }
    let mut v = [0usize; 4];
    for (slot, p) in v.iter_mut().zip(&parts) {
        *slot = p
            .parse()
            .with_context(|| format!("--gemm {s:?}: {p:?} is not a non-negative integer"))?;
    }
    Ok(v)
}

/// Runs the search and prints the report.
pub fn run(args: TuneArgs) -> anyhow::Result<ExitCode> {
    let [batch, m, n, k] = parse_shape(&args.gemm)?;
    let dtype: DType = args.dtype.parse()?;
    let compute: Compute = args.compute.parse()?;
    let p = Problem::packed_trans(batch, m, n, k, args.trans_a, args.trans_b)
        .with_compute(compute)
        .with_scalars(args.alpha, args.beta);
    let config = Config::from_env_once()?;
    let ctx = Context::with_config(args.device, config.clone())?;
    let tag = gemm::device_tag(&ctx)?;

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
    let result = gemm::search_with(&ctx, &p, dtype, Alignment::MAX, &mut on_progress);
    bar.finish_and_clear();
    let r = result?;

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
        gemm::KEEP_DEFAULT_MARGIN * 100.0
    );
    let speedup = match r.candidates.get(r.winner).and_then(|c| c.vs_default()) {
        Some(v) if r.winner != 0 => format!("{:.3}x the cuBLAS default", 1.0 / v.median),
        _ => "the cuBLAS default itself".into(),
    };
    println!("winner: #{} {} ({speedup})", r.winner, r.choice.label());
    match &config.tuning_cache {
        Some(path) => {
            let stored = gemm::cache::load_file(path, &tag, r.key.device)
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
