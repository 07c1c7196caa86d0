//! Host and GPU cost of a cached convolution through cuDNN's graph API, next to nnfuse's legacy
//! cuDNN route, per problem (f16 NHWC, 3x3, pad 1):
//!
//! - (a) `run_cached`: nnfuse's graph route as a caller uses it (checks, cache lookup, lock,
//!   variant pack reuse, `cudnnBackendExecute`);
//! - (b) a bare `cudnnBackendExecute` of the same plan with a variant pack built beforehand
//!   (the floor of the graph API's host cost);
//! - (c) `Conv2d::forward_with(Route::path(ConvPath::Cudnn))`: the legacy
//!   `cudnnConvolutionForward` route.
//!
//! Host time two ways: "loop" = µs per call over rounds of back-to-back calls (host-bound only
//! while the GPU keeps up: on large problems it is the GPU's time), and "queue" = µs to queue
//! one call right after a synchronize (the host's own cost at any size). GPU time per call is
//! the median of CUDA-event samples, printed with the physical floor: FLOPs over 700 TFLOP/s
//! (H100 f16 dense) or bytes over 3.0 TB/s, whichever is larger.

#[path = "support/host_time.rs"]
mod host_time;
#[path = "support/shapes.rs"]
mod shapes;

use half::f16;
use nnfuse::conv::{Conv2d, ConvPath, ConvShape, Direction, Route};
use nnfuse::internals::cudnn_graph::{
    available, execute, run_cached, GraphConv, GraphConvKey, GraphPolicy, VariantPack,
};
use nnfuse::{Config, Context, DType};

use cudarc::driver::{DevicePtr, DevicePtrMut};

use host_time::{gpu_us, loop_us, queue_us};

const CALLS: usize = 200;
const ROUNDS: usize = 7;
const PEAK_FLOPS: f64 = 700e12;
const PEAK_BYTES: f64 = 3.0e12;

/// `(loop µs per call, queue µs after a synchronize, GPU µs per call)` of `f`.
fn measure(
    ctx: &Context,
    mut f: impl FnMut() -> nnfuse::Result<()>,
) -> nnfuse::Result<(f64, f64, f64)> {
    for _ in 0..20 {
        f()?;
    }
    ctx.synchronize()?;
    let host = loop_us(ctx, &mut f, CALLS, ROUNDS)?;
    let queue = queue_us(ctx, &mut f)?;
    Ok((host, queue, gpu_us(ctx, f, 50.0)?))
}

fn row(problem: &str, what: &str, floor_us: f64, r: nnfuse::Result<(f64, f64, f64)>) {
    match r {
        Ok((host, queue, gpu)) => {
            println!("| {problem} | {what} | {host:.1} | {queue:.1} | {gpu:.1} | {floor_us:.1} |");
            println!(
                "{{\"bench\":\"cudnn_graph\",\"problem\":\"{problem}\",\"case\":\"{what}\",\
                 \"loop_us\":{host:.2},\"queue_us\":{queue:.2},\"gpu_us\":{gpu:.2},\
                 \"floor_us\":{floor_us:.2}}}"
            );
        }
        Err(e) => println!("| {problem} | {what} | error: {e} | - | - | {floor_us:.1} |"),
    }
}

fn problem(n: usize, c: usize, hw: usize) -> ConvShape {
    shapes::square3x3(n, c, hw, c)
}

/// The physical floor in µs of a forward convolution of `s` with 2-byte elements.
fn floor_us(s: &ConvShape) -> nnfuse::Result<f64> {
    let (oh, ow) = s.out_hw()?;
    let flops = 2.0 * (s.n * s.c_out * oh * ow * s.c_in * s.kh * s.kw) as f64;
    let bytes = 2.0 * (s.x_len().unwrap() + s.w_len().unwrap() + s.y_len()?) as f64;
    Ok((flops / PEAK_FLOPS).max(bytes / PEAK_BYTES) * 1e6)
}

fn bench_problem(ctx: &Context, name: &str, s: &ConvShape) -> anyhow::Result<()> {
    let st = ctx.stream().clone();
    let floor = floor_us(s)?;
    let x = st.clone_htod(&vec![f16::from_f32(0.1); s.x_len().unwrap()])?;
    let w = st.clone_htod(&vec![f16::from_f32(0.01); s.w_len().unwrap()])?;
    let mut y = st.alloc_zeros::<f16>(s.y_len()?)?;
    let policy = GraphPolicy::default();
    row(
        name,
        "(a) graph route, run_cached",
        floor,
        measure(ctx, || {
            run_cached(ctx, s, Direction::Forward, policy, &x, &w, &mut y)
        }),
    );
    let plan = GraphConv::cached(ctx, GraphConvKey::new(*s, DType::F16, Direction::Forward));
    match plan {
        Ok(plan) => {
            println!(
                "<!-- {name}: engine {}, workspace {} bytes -->",
                plan.chosen(),
                plan.workspace_bytes()
            );
            let (px, _a) = x.device_ptr(&st);
            let (pw, _b) = w.device_ptr(&st);
            let (py, _c) = y.device_ptr_mut(&st);
            let (h, ws) = {
                let mut g = ctx.lock()?;
                (g.cudnn()?, g.workspace(plan.workspace_bytes())?)
            };
            let pack = VariantPack::new([px, pw, py], ws)?;
            row(
                name,
                "(b) bare cudnnBackendExecute, prebuilt pack",
                floor,
                measure(ctx, || {
                    // SAFETY: the buffers and the workspace outlive the measurement; one thread,
                    // the Context's stream (the handle is bound to it).
                    unsafe { execute(h, plan.plan(), &pack) }
                }),
            );
        }
        Err(e) => println!("| {name} | (b) bare execute | no plan: {e} | - | - | {floor:.1} |"),
    }
    let conv = Conv2d::<f16>::new(ctx, s)?;
    let route = Route::path(ConvPath::Cudnn);
    row(
        name,
        "(c) Conv2d::forward_with(cudnn), legacy",
        floor,
        measure(ctx, || conv.forward_with(route, &x, &w, &mut y)),
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    if !nnfuse::context::driver_present() {
        println!("cudnn_graph: no CUDA driver; nothing measured");
        return Ok(());
    }
    let ctx = Context::with_config(0, Config::default())?;
    let version = match available() {
        Ok(v) => v,
        Err(e) => {
            println!("cudnn_graph: the graph API is unavailable: {e}");
            return Ok(());
        }
    };
    println!("# Convolution forward through cuDNN's graph API vs the legacy call (f16 NHWC 3x3)\n");
    println!("{}, cuDNN {version}\n", ctx.info());
    println!(
        "| problem | case | host µs per call (loop) | host µs to queue one call (after sync) | \
         GPU µs per call | floor µs |\n|---|---|---|---|---|---|"
    );
    for (name, s) in [
        ("n1 c8 8x8", problem(1, 8, 8)),
        ("n32 c64 56x56", problem(32, 64, 56)),
        ("n32 c96 35x35", problem(32, 96, 35)),
        ("n64 c64 56x56", problem(64, 64, 56)),
    ] {
        if let Err(e) = bench_problem(&ctx, name, &s) {
            println!("| {name} | - | error: {e} | - | - | - |");
        }
    }
    Ok(())
}
