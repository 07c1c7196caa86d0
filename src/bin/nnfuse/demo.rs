//! `nnfuse demo`: the whole library at work in one command — a ResNet-50 bottleneck block's
//! training step (convolutions forward and both gradients through `nnfuse::conv::Conv2d`,
//! BatchNorm+ReLU and BatchNorm+Add+ReLU through `nnfuse::batchnorm::BatchNorm`, the block
//! input's two gradients summed) plus ResNet-50's classifier GEMM, checked against f64 and timed
//! against the same block composed from plain cuDNN calls. `docs/DEMO.md` describes what it
//! runs, how to read its output and its exit statuses.
//!
//! Files: `block` (the block and its step as data, FLOPs, bytes, floors), `variants` (nnfuse
//! and the plain-cuDNN compositions as configurations), `plans` (every layer's plan without a
//! GPU), `reference` (f64 convolution gradients and GEMMs), `check` (the per-operation
//! comparison), `bits` (`--graph`'s bit-for-bit comparison), `report` (text and JSON),
//! `host_profile` (`--profile-host`'s breakdown, text and JSON) — all pure — `units` (nnfuse's
//! fused forward units: ConvStats then BatchNorm from its sums, and their decision's rule), and
//! `gpu` (buffers, steps, the units' first-step timing, timing), `host` (host time while the GPU is busy, the profiled steps) and
//! `graph` (`--graph`: capture, replay).

mod bits;
mod block;
mod check;
mod gpu;
mod graph;
mod host;
mod host_profile;
mod inference;
mod plans;
mod reference;
mod report;
mod units;
mod variants;

/// Deterministic test data for the demo's unit tests: xorshift64 values uniform in `[lo, hi)`.
#[cfg(test)]
fn test_values(seed: u64, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            lo + (hi - lo) * ((s >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect()
}

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use half::{bf16, f16};
use indicatif::{ProgressBar, ProgressStyle};
use nnfuse::batchnorm::ASSUMED_CUDNN_VERSION;
use nnfuse::context::{
    cublas_present, cublas_version, cublaslt_present, cublaslt_version, cudnn_present,
    cudnn_version, driver_present,
};
use nnfuse::internals::kernels;
use nnfuse::{Config, Context, DType, Element, Error, TensorFormat};

use block::BlockDef;
use plans::plan_block;
use report::{Report, Status};
use variants::Variant;

/// Arguments of `nnfuse demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Batch of the timed training steps (at most 2674: the block's largest activation,
    /// 256x56x56 per sample, must have fewer than 2^31 elements).
    #[arg(long, default_value_t = 32, allow_negative_numbers = true, value_parser = crate::non_negative::<usize>)]
    batch: usize,
    /// Element type of activations, filters and the GEMM: f16, bf16 or f32.
    #[arg(long, default_value = "f16")]
    dtype: String,
    /// Memory format: nhwc (KRSC filters) or nchw (KCRS filters).
    #[arg(long, default_value = "nhwc")]
    format: String,
    /// Timed training steps (after the untimed warm-up steps), 1 to 10000.
    #[arg(long, default_value_t = 20, allow_negative_numbers = true, value_parser = crate::non_negative::<usize>)]
    steps: usize,
    /// Batch of the correctness check against f64 (at most --batch).
    #[arg(long, default_value_t = 2, allow_negative_numbers = true, value_parser = crate::non_negative::<usize>)]
    check_batch: usize,
    /// Skip the correctness check.
    #[arg(long)]
    no_check: bool,
    /// Print exactly one JSON object on stdout (no progress bar, no text).
    #[arg(long)]
    json: bool,
    /// Print every plan in full (every path's eligibility and every reason).
    #[arg(long)]
    explain: bool,
    /// Seed of the random inputs (default: from the clock, printed).
    #[arg(long, allow_negative_numbers = true, value_parser = crate::non_negative::<u64>)]
    seed: Option<u64>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = crate::non_negative::<usize>)]
    device: usize,
    /// Also capture nnfuse's whole step into a CUDA graph, check a replay bit for bit against
    /// eager and time the replays (exit status 1 when the bits differ, 4 when the step cannot
    /// be captured). Turns cudarc's event tracking off for every variant.
    #[arg(long)]
    graph: bool,
    /// After the timing, queue nnfuse's step --steps more times while the GPU is busy with the
    /// library's host-time profiler on, and print nnfuse's host time per step by stage
    /// (validation, events, lookups, workspace, packs, allocation, vendor call, launches) and
    /// by operation (JSON: `host_profile`).
    #[arg(long)]
    profile_host: bool,
    /// Run the block forward-only for inference instead (docs/DEMO.md, "--inference"): each
    /// conv → BN → (+x) → ReLU unit folded into one convolution with a fused epilogue
    /// (nnfuse::block::ConvBnInference) against the same units unfused, both checked against
    /// f64 and timed against each other (GPU time per block; --steps sets the rounds).
    #[arg(long)]
    inference: bool,
}

/// What the GPU part runs besides the check and the timing.
#[derive(Debug, Clone, Copy)]
struct Extras {
    /// `--graph`.
    graph: bool,
    /// `--profile-host`.
    profile_host: bool,
}

/// Loops of `--steps` steps per variant for the loop time (and of replays with `--graph`).
const LOOPS: usize = 7;

fn parse_format(s: &str) -> nnfuse::Result<TensorFormat> {
    match s.trim().to_ascii_lowercase().as_str() {
        "nhwc" => Ok(TensorFormat::Nhwc),
        "nchw" => Ok(TensorFormat::Nchw),
        _ => Err(Error::invalid(
            "--format",
            format!("{s:?} is not nhwc or nchw"),
        )),
    }
}

fn at_least_one(flag: &str, v: usize) -> nnfuse::Result<usize> {
    if v == 0 {
        return Err(Error::invalid(flag, "must be at least 1"));
    }
    Ok(v)
}

/// The most timed steps: enough for any timing, few enough that a typo (an extra 0 or three)
/// is an error instead of an hour of GPU time.
const MAX_STEPS: usize = 10_000;

/// The batch checked against the block's largest activation, which must have fewer than 2^31
/// elements (the i32 of cuDNN's descriptors and nnfuse's kernels): an error naming `flag`.
fn batch_fits(
    flag: &str,
    batch: usize,
    dtype: DType,
    format: TensorFormat,
) -> nnfuse::Result<usize> {
    let one = BlockDef::resnet50(1, dtype, format);
    let per_sample = one.act_len(one.c.max(one.mid));
    let max = i32::MAX as usize / per_sample;
    if batch > max {
        return Err(Error::invalid(
            flag,
            format!(
                "{batch} makes the block's largest activation ({} x {}x{} per sample) {} \
                 elements, more than {} (i32); at most {max}",
                one.c.max(one.mid),
                one.hw,
                one.hw,
                batch as u128 * per_sample as u128,
                i32::MAX
            ),
        ));
    }
    Ok(batch)
}

/// `9.19.0 (91900)`.
fn cudnn_string(v: usize) -> String {
    format!("{}.{}.{} ({v})", v / 10_000, (v / 100) % 100, v % 100)
}

/// What the machine has, one line each; the libraries' versions or "missing".
fn environment(ctx: Option<&Context>) -> Vec<String> {
    let mut lines = Vec::new();
    if let Some(c) = ctx {
        lines.push(c.info().to_string());
    }
    let v = |r: nnfuse::Result<String>| r.unwrap_or_else(|_| "missing".into());
    lines.push(format!(
        "libraries: cuDNN {}, cuBLAS {}, cuBLASLt {}, NVRTC {}",
        v(cudnn_version().map(cudnn_string)),
        v(cublas_version().map(|(a, b, c)| format!("{a}.{b}.{c}"))),
        v(cublaslt_version().map(|x| x.to_string())),
        v(kernels::nvrtc_version().map(|(a, b)| format!("{a}.{b}")))
    ));
    lines
}

/// The device's Context, or one line saying everything that is missing to run the demo.
fn probe(device: usize, config: &Config) -> Result<Context, String> {
    let mut missing = Vec::new();
    let mut ctx = None;
    if !driver_present() {
        missing.push("the CUDA driver (libcuda.so.1 not found: no GPU driver here)".to_string());
    } else {
        match Context::with_config(device, config.clone()) {
            Ok(c) => ctx = Some(c),
            Err(e) => missing.push(format!("CUDA device {device} ({e})")),
        }
    }
    for (present, what) in [
        (cudnn_present(), "cuDNN (libcudnn.so.9)"),
        (cublas_present(), "cuBLAS (libcublas.so.13)"),
        (cublaslt_present(), "cuBLASLt (libcublasLt.so.13)"),
        (kernels::nvrtc_present(), "NVRTC (libnvrtc.so.13)"),
    ] {
        if !present {
            missing.push(what.to_string());
        }
    }
    match ctx {
        Some(c) if missing.is_empty() => Ok(c),
        _ => Err(format!(
            "nnfuse demo cannot run here: missing {}; the layers' plans need none and were \
             printed (exit status 3)",
            missing.join(", ")
        )),
    }
}

fn progress(json: bool, total: u64) -> ProgressBar {
    if json {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    if let Ok(style) =
        ProgressStyle::with_template("{spinner} [{bar:30}] {pos}/{len} {elapsed} {wide_msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.enable_steady_tick(Duration::from_millis(100));
    bar
}

/// Runs the demo; the exit status is 0 (checked and timed), 1 (check failed, or `--graph`'s
/// replay differs from eager), 3 (no GPU: plans printed), 4 (`--graph`: the step could not be
/// captured); errors (invalid arguments, a failing library call) exit 2 from `main`.
pub fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let dtype: DType = args.dtype.parse().map_err(|_| {
        Error::invalid(
            "--dtype",
            format!("{:?} is not one of f16, bf16, f32", args.dtype),
        )
    })?;
    let format = parse_format(&args.format)?;
    let batch = batch_fits(
        "--batch",
        at_least_one("--batch", args.batch)?,
        dtype,
        format,
    )?;
    let steps = at_least_one("--steps", args.steps)?;
    if steps > MAX_STEPS {
        return Err(Error::invalid("--steps", format!("{steps} is more than {MAX_STEPS}")).into());
    }
    let check_batch = if args.no_check {
        None
    } else {
        let b = at_least_one("--check-batch", args.check_batch)?;
        if b > batch {
            return Err(Error::invalid(
                "--check-batch",
                format!(
                    "{b} is more than --batch {batch}: the check runs a smaller copy of the step"
                ),
            )
            .into());
        }
        Some(b)
    };
    if args.inference && (args.graph || args.profile_host) {
        return Err(Error::invalid(
            "--inference",
            "runs alone: --graph and --profile-host measure the training step",
        )
        .into());
    }
    let config = Config::from_env()?;
    let def = BlockDef::resnet50(batch, dtype, format);
    let present = cudnn_present();
    let version = if present {
        cudnn_version().unwrap_or(ASSUMED_CUDNN_VERSION)
    } else {
        ASSUMED_CUDNN_VERSION
    };
    let short = |v: usize| format!("{}.{}.{}", v / 10_000, (v / 100) % 100, v % 100);
    let plan_basis = if present {
        format!("cuDNN {} found", short(version))
    } else {
        format!(
            "cuDNN not found: convolutions planned without it, BatchNorm for cuDNN {}, assumed",
            short(version)
        )
    };
    let plans = Variant::ALL
        .iter()
        .map(|&v| plan_block(&def, v, &config, present, version))
        .collect::<nnfuse::Result<Vec<_>>>()?;
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let probed = probe(args.device, &config);
    let mut report = Report {
        def,
        check_batch,
        steps,
        seed,
        config,
        environment: environment(probed.as_ref().ok()),
        plans,
        plan_basis,
        missing: None,
        runs: Vec::new(),
        check: None,
        head_start: None,
        graph: None,
        host_profile: None,
        status: Status::Ok,
    };
    let ctx = match probed {
        Ok(c) => c,
        Err(line) => {
            report.missing = Some(line.clone());
            report.status = Status::NoGpu;
            if args.json {
                println!("{}", serde_json::to_string(&report.to_json())?);
                eprintln!("{line}");
            } else {
                print!("{}", report.to_text(args.explain));
            }
            return Ok(ExitCode::from(Status::NoGpu.code()));
        }
    };
    if args.inference {
        return run_inference(&ctx, &report, &args);
    }
    if args.graph {
        // cudarc records an event on every use of a tracked buffer (tracking is on because the
        // Context owns a stream of its own). An event recorded during a capture can no longer be
        // waited for or synchronized outside it, so every buffer the captured step touches must
        // be untracked: the step's buffers, and the library's own (workspace, scratch, saved
        // BatchNorm state), which are all allocated after this point. Off only under --graph,
        // so that a plain run measures what a caller gets by default; every variant shares
        // this CUDA context, so the eager numbers of a --graph run are all untracked.
        // SAFETY: every buffer lives on the Context's one stream (all variants share it), so
        // no cross-stream synchronisation is lost; none has been allocated yet.
        unsafe { ctx.cuda().disable_event_tracking() };
    }
    if !args.json {
        print!("{}", report.head_text(args.explain));
    }
    let extras = Extras {
        graph: args.graph,
        profile_host: args.profile_host,
    };
    let result = match dtype {
        DType::F32 => on_gpu::<f32>(&ctx, &mut report, args.json, extras),
        DType::F16 => on_gpu::<f16>(&ctx, &mut report, args.json, extras),
        DType::BF16 => on_gpu::<bf16>(&ctx, &mut report, args.json, extras),
    };
    result?;
    if args.json {
        println!("{}", serde_json::to_string(&report.to_json())?);
    } else {
        print!("{}", report.results_text());
    }
    Ok(ExitCode::from(report.status.code()))
}

/// The GPU part: warm-up, check, timed steps, loops, host times, profile, graph; fills
/// `report`.
fn on_gpu<T: Element>(
    ctx: &Context,
    report: &mut Report,
    json: bool,
    extras: Extras,
) -> anyhow::Result<()> {
    let n = Variant::ALL.len() as u64;
    let total = n * (1 + u64::from(report.check_batch.is_some()) + report.steps as u64)
        + n * LOOPS as u64
        + 1
        + u64::from(extras.profile_host)
        + u64::from(extras.graph);
    let bar = progress(json, total);
    let result = run_phases::<T>(ctx, report, &bar, extras);
    // Cleared on failure too, so that an error message is not drawn over.
    bar.finish_and_clear();
    let runs = result?;
    report.runs = runs;
    Ok(())
}

/// Warm-up, check, then (when the check passed) the timed steps, loops and host times, with
/// `--profile-host` the profiled steps and with `--graph` the capture; the runs of every
/// variant.
fn run_phases<T: Element>(
    ctx: &Context,
    report: &mut Report,
    bar: &ProgressBar,
    extras: Extras,
) -> anyhow::Result<Vec<report::VariantRun>> {
    let mut session = gpu::Session::<T>::new(ctx, &report.def, report.seed)?;
    let (mut runs, host_ms) = session.warm_up(bar)?;
    if let Some(b) = report.check_batch {
        let c = session.check(b, bar)?;
        if !c.passed() {
            report.status = Status::CheckFailed;
        }
        report.check = Some(c);
    }
    if report.status == Status::Ok {
        report.head_start = Some(session.time(report.steps, host_ms, &mut runs, bar)?);
        session.loops(report.steps, LOOPS, &mut runs, bar)?;
        bar.set_message("host time per step while the GPU is busy");
        let mut busy = session.busy_host(report.steps, &mut runs)?;
        bar.inc(1);
        if extras.profile_host {
            bar.set_message("--profile-host: profiled steps");
            report.host_profile = Some(session.profile_host(report.steps, &mut busy)?);
            bar.inc(1);
        }
    }
    if report.status == Status::Ok && extras.graph {
        bar.set_message("--graph: capture, bit check, replays");
        let g = session.graph(report.steps, LOOPS)?;
        if g.not_capturable.is_some() {
            report.status = Status::NotCapturable;
        } else if !g.passed() {
            report.status = Status::GraphDiffers;
        }
        report.graph = Some(g);
        bar.inc(1);
    }
    Ok(runs)
}

/// `--inference`: the forward-only block, folded against unfused; exit status 0 or 1 (check
/// failed).
fn run_inference(ctx: &Context, report: &Report, args: &DemoArgs) -> anyhow::Result<ExitCode> {
    let def = &report.def;
    let run = match def.dtype {
        DType::F32 => {
            inference::run::<f32>(ctx, def, report.check_batch, report.seed, report.steps)
        }
        DType::F16 => {
            inference::run::<f16>(ctx, def, report.check_batch, report.seed, report.steps)
        }
        DType::BF16 => {
            inference::run::<bf16>(ctx, def, report.check_batch, report.seed, report.steps)
        }
    }?;
    if args.json {
        println!("{}", serde_json::to_string(&run.json)?);
    } else {
        for l in environment(Some(ctx)) {
            println!("{l}");
        }
        for l in &run.lines {
            println!("{l}");
        }
    }
    let status = if run.passed {
        Status::Ok
    } else {
        Status::CheckFailed
    };
    Ok(ExitCode::from(status.code()))
}
