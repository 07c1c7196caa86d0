//! The convolution suite: every problem of `benches/conv_problems.txt` (ResNet-18/50, VGG,
//! Inception, MobileNet pointwise, dilated, strided, odd channels; batch 1 to 128; f16/bf16 NHWC
//! and f32 NCHW), forward, data gradient and filter gradient, through `Conv2d` exactly as a
//! framework calls it (`auto`). `benches/pytorch/conv_suite.py` times the same problems with
//! PyTorch (`cudnn.benchmark = True`) and `benches/pytorch/compare_conv.py` joins the two.
//!
//! Per problem-direction it reports:
//! - **first call**: wall time of the first call of a fresh `Conv2d` (its decision, any
//!   measurement and kernel compilation included) up to a synchronize;
//! - **GPU µs per call**: CUDA events around bursts of K ≥ 8 calls queued behind a head start of
//!   GPU work (kernel fills), so that the host runs ahead and a host-heavy call is not judged
//!   by its host time; median over samples of the per-call mean. The steady state: timed after
//!   the first call's background kernel compiles finished (a later call may then decide again,
//!   and a compile's module load holds the driver's locks against the timed calls); a sample
//!   whose head start ran out before its burst was queued (the GPU could have waited on the
//!   host) is taken again behind twice the fills, up to three times;
//! - **host µs per call**: wall time of queuing those bursts, per call;
//! - the **floor**: FLOPs (`2·N·K·C·R·S·OH·OW`) over the tensor/FMA peak, or bytes (each
//!   operand read or written once) over the 3.0 TB/s copy bandwidth, whichever is larger.
//!
//! `cargo bench --bench conv_suite [-- --filter NAME] [--json FILE] [--burst K]` (on a GPU). JSON lines
//! (one per problem-direction) go to `--json FILE` for `compare_conv.py`.

#[path = "support/conv_problems.rs"]
mod conv_problems;
#[path = "support/exit.rs"]
mod exit;

use std::io::Write;
use std::time::Instant;

use std::sync::Arc;

use conv_problems::ConvProblem;
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use half::{bf16, f16};
use nnfuse::conv::{Conv2d, ConvShape, Direction};
use nnfuse::{Context, Element};
use serde_json::json;

/// H100 SXM datasheet dense peaks: f16/bf16 tensor cores, f32 FMA (nnfuse's f32 never uses
/// TF32).
const PEAK_HALF_TFLOPS: f64 = 989.4;
const PEAK_F32_TFLOPS: f64 = 66.9;
/// Device-to-device copy bandwidth measured on the H100 (`../shared/GPU-FACTS.md`).
const COPY_TBPS: f64 = 3.0;
/// f32 elements of the head-start buffer: one fill is ~0.35 ms of GPU work on an H100.
const HEAD_START_ELEMS: usize = 256 << 20;
/// Fewest calls per burst: the two events' own ~2 µs are spread over at least this many calls
/// (a burst of one host-heavy call once read a 18 µs layer as 20 µs); a slow host gets more
/// fills instead.
const MIN_BURST: usize = 8;
/// Times a sample whose head start ran out is taken again (behind twice the fills each time).
const MAX_RETAKES: usize = 3;
/// Samples per problem-direction (median taken).
const SAMPLES: usize = 15;

/// Deterministic uniform values in [-1, 1) (a 64-bit LCG): fresh per buffer, never zeros.
fn uniform(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn upload<T: Element + DeviceRepr>(
    s: &Arc<CudaStream>,
    len: usize,
    seed: u64,
) -> anyhow::Result<CudaSlice<T>> {
    let host: Vec<T> = uniform(len, seed)
        .into_iter()
        .map(|v| T::from_f64(v as f64))
        .collect();
    Ok(s.clone_htod(&host)?)
}

/// What one problem-direction measured.
struct Measured {
    first_ms: f64,
    gpu_us: f64,
    host_us: f64,
    route: String,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Times `call` as the module documentation says: first call, then bursts behind a head start.
fn measure(
    ctx: &Context,
    head: &mut CudaSlice<f32>,
    mut call: impl FnMut() -> nnfuse::Result<()>,
) -> anyhow::Result<(f64, f64, f64)> {
    let s = ctx.stream();
    let t = Instant::now();
    call()?;
    ctx.synchronize()?;
    let first_ms = t.elapsed().as_secs_f64() * 1e3;
    nnfuse::internals::kernels::wait_for_background_compiles();
    // Warm-up (a repeated cuDNN graph-API call is captured for replay at its second call:
    // hundreds of µs once), then a host-time estimate of the steady state to size the bursts.
    for _ in 0..3 {
        call()?;
    }
    ctx.synchronize()?;
    let t = Instant::now();
    for _ in 0..3 {
        call()?;
    }
    let host_est_us = t.elapsed().as_secs_f64() * 1e6 / 3.0;
    ctx.synchronize()?;
    // A burst's queuing must fit in the head start (fills of ~350 µs each, kernels as in
    // `nnfuse demo`: device memsets did not hold the GPU back): K calls, and more fills when
    // even one call queues slower than that.
    let k = BURST
        .get()
        .copied()
        .flatten()
        .unwrap_or(((200.0 / host_est_us.max(1.0)) as usize).clamp(MIN_BURST, 20));
    let mut fills = ((host_est_us * k as f64) / 200.0).ceil().max(1.0) as usize;
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let (mut gpu, mut host) = (Vec::new(), Vec::new());
    let mut retaken = 0;
    let _ = nnfuse::internals::profile::take();
    for _ in 0..SAMPLES {
        for attempt in 0..=MAX_RETAKES {
            for _ in 0..fills {
                nnfuse::internals::util::fill(ctx, head, 0.0)?;
            }
            let a = ctx.cuda().new_event(flags)?;
            let b = ctx.cuda().new_event(flags)?;
            a.record(s)?;
            let t = Instant::now();
            for _ in 0..k {
                call()?;
            }
            let host_us = t.elapsed().as_secs_f64() * 1e6 / k as f64;
            // The GPU reached the burst before the host had queued it: it may have waited.
            let drained = a.is_complete();
            b.record(s)?;
            b.synchronize()?;
            if drained && attempt < MAX_RETAKES {
                retaken += 1;
                fills *= 2;
                continue;
            }
            host.push(host_us);
            gpu.push(a.elapsed_ms(&b)? as f64 * 1e3 / k as f64);
            break;
        }
    }
    if std::env::var_os("NNFUSE_SUITE_REPORTS").is_some() {
        // Per-sample figures: a median hides a call that sometimes waits for the GPU.
        let f = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.1}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        println!(
            "<!-- samples: warm-up host {host_est_us:.1} µs/call, k {k}, fills {fills}, \
             {retaken} taken again (head start ran out); host µs/call [{}]; GPU µs/call [{}] -->",
            f(&host),
            f(&gpu)
        );
        if nnfuse::internals::profile::enabled() {
            // NNFUSE_PROFILE_HOST=1: where the sampled calls' host time went, per call.
            let t = nnfuse::internals::profile::take();
            let calls = (host.len() * k).max(1) as f64;
            let stages: Vec<String> = nnfuse::internals::profile::Stage::ALL
                .iter()
                .map(|&st| format!("{st:?} {:.1}", t.ns_of(st) as f64 / 1e3 / calls))
                .collect();
            println!("<!-- host µs/call by stage: {} -->", stages.join(", "));
        }
    }
    Ok((first_ms, median(gpu), median(host)))
}

/// The floor of one direction in µs: FLOPs over the peak or bytes over the copy bandwidth.
fn floor_us(shape: &ConvShape, elem: usize, half: bool) -> anyhow::Result<f64> {
    let (oh, ow) = shape.out_hw()?;
    let flops = 2.0 * (shape.n * shape.c_out * shape.c_in * shape.kh * shape.kw * oh * ow) as f64;
    let peak = if half {
        PEAK_HALF_TFLOPS
    } else {
        PEAK_F32_TFLOPS
    };
    let bytes = ((shape.x_len().unwrap() + shape.w_len().unwrap() + shape.y_len()?) * elem) as f64;
    Ok((flops / (peak * 1e6)).max(bytes / (COPY_TBPS * 1e6)))
}

fn run_problem<T: Element + DeviceRepr>(
    ctx: &Context,
    p: &ConvProblem,
    head: &mut CudaSlice<f32>,
) -> anyhow::Result<Vec<(Direction, Measured)>> {
    let s = ctx.stream();
    let sh = &p.shape;
    let x = upload::<T>(s, sh.x_len().unwrap(), 1)?;
    let w = upload::<T>(s, sh.w_len().unwrap(), 2)?;
    let dy = upload::<T>(s, sh.y_len()?, 3)?;
    let mut y = s.alloc_zeros::<T>(sh.y_len()?)?;
    let mut dx = s.alloc_zeros::<T>(sh.x_len().unwrap())?;
    let mut dw = s.alloc_zeros::<T>(sh.w_len().unwrap())?;
    let conv = Conv2d::<T>::new(ctx, sh)?;
    let mut out = Vec::new();
    for d in [
        Direction::Forward,
        Direction::BackwardData,
        Direction::BackwardFilter,
    ] {
        let (first_ms, gpu_us, host_us) = match d {
            Direction::Forward => measure(ctx, head, || conv.forward(&x, &w, &mut y))?,
            Direction::BackwardData => measure(ctx, head, || conv.backward_data(&dy, &w, &mut dx))?,
            Direction::BackwardFilter => {
                measure(ctx, head, || conv.backward_filter(&x, &dy, &mut dw, false))?
            }
        };
        let route = conv
            .choice(d)
            .map(|c| c.route.to_string())
            .unwrap_or_else(|| "?".into());
        // Where a slow first call went: the choice (notes) and its measurement's phases.
        if std::env::var_os("NNFUSE_SUITE_REPORTS").is_some() {
            if let Some(c) = conv.choice(d) {
                println!("<!-- {} {:?} first {first_ms:.1} ms: {c}", p.name, d);
                for n in &c.notes {
                    println!("note: {n}");
                }
                if let Some(r) = conv.report(d) {
                    println!("{r}");
                }
                println!("-->");
            }
        }
        out.push((
            d,
            Measured {
                first_ms,
                gpu_us,
                host_us,
                route,
            },
        ));
    }
    Ok(out)
}

fn direction_name(d: Direction) -> &'static str {
    match d {
        Direction::Forward => "fwd",
        Direction::BackwardData => "dgrad",
        Direction::BackwardFilter => "wgrad",
    }
}

/// `--burst K`: K calls per sample whatever the warm-up's host time (how a call's GPU time depends
/// on whether it follows other GPU work or a call of its own).
static BURST: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();

fn main() -> std::process::ExitCode {
    // Decisions' traces (timestamped, on stderr) where NNFUSE_LOG asks for them.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("NNFUSE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    exit::finish("conv_suite", run())
}

fn run() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let filter = arg("--filter").unwrap_or_default();
    let burst = arg("--burst").map(|k| k.parse::<usize>()).transpose()?;
    let _ = BURST.set(burst.map(|k| k.max(1)));
    let mut json_out = match arg("--json") {
        Some(path) => Some(std::fs::File::create(path)?),
        None => None,
    };
    let problems =
        conv_problems::parse(include_str!("conv_problems.txt")).map_err(anyhow::Error::msg)?;
    let ctx = Context::new(0)?;
    println!(
        "# Convolution suite: nnfuse auto, {} problems\n",
        problems.len()
    );
    println!("{}\n", ctx.info());
    println!("| problem | type | dir | route | first call ms | GPU µs | host µs | floor µs | floor / GPU |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut head = ctx.stream().alloc_zeros::<f32>(HEAD_START_ELEMS)?;
    for p in problems.iter().filter(|p| p.name.contains(&filter)) {
        let (rows, elem, half) = match p.dtype.as_str() {
            "f16" => (run_problem::<f16>(&ctx, p, &mut head), 2, true),
            "bf16" => (run_problem::<bf16>(&ctx, p, &mut head), 2, true),
            _ => (run_problem::<f32>(&ctx, p, &mut head), 4, false),
        };
        let rows = match rows {
            Ok(r) => r,
            Err(e) => {
                println!("| {} | {} | - | ERROR: {e} | | | | | |", p.name, p.dtype);
                continue;
            }
        };
        let floor = floor_us(&p.shape, elem, half)?;
        for (d, m) in rows {
            println!(
                "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} |",
                p.name,
                p.dtype,
                direction_name(d),
                m.route,
                m.first_ms,
                m.gpu_us,
                m.host_us,
                floor,
                floor / m.gpu_us
            );
            if let Some(f) = json_out.as_mut() {
                let line = json!({
                    "impl": "nnfuse", "problem": p.name, "dtype": p.dtype,
                    "dir": direction_name(d), "route": m.route, "first_ms": m.first_ms,
                    "gpu_us": m.gpu_us, "host_us": m.host_us, "floor_us": floor,
                });
                writeln!(f, "{line}")?;
            }
        }
        ctx.synchronize()?;
    }
    Ok(())
}
