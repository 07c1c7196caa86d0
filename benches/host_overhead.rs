//! Host overhead per call: how long the host takes to validate, dispatch and queue one call of
//! each operation and route, on problems so small that the GPU keeps up with the host (so the
//! wall time of many back-to-back calls is the host's). A framework's step is host-bound when
//! these numbers exceed its kernels' GPU time.
//!
//! For each case: warm-up (first calls pay plans, searches, `auto`'s measurement, NVRTC), then
//! rounds of `CALLS` calls timed on the host without synchronising inside a round; the median
//! round gives µs per call. The GPU time of one call (CUDA events) is printed next to it: when
//! it is close to the host time the case is GPU-bound and the host number is an upper bound.

#[path = "support/exit.rs"]
mod exit;
#[path = "support/host_time.rs"]
mod host_time;
#[path = "support/shapes.rs"]
mod shapes;

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use half::f16;
use nnfuse::batchnorm::{BackwardArgs, BatchNorm, Fuse, TrainArgs};
use nnfuse::conv::{Conv2d, ConvPath, Route, WinogradEngine, WinogradTile};
use nnfuse::gemm::{self, Problem};
use nnfuse::{BnImpl, Config, Context};

use host_time::{gpu_us, loop_us, queue_us};

const CALLS: usize = 400;
const ROUNDS: usize = 7;

/// Host µs to queue one call of `f` right after the GPU went idle (`synchronize` before each
/// call, not timed): what a framework pays when it synchronises every step (e.g. to read a
/// loss), including whatever the idle period released (the stream-ordered memory pool trims
/// its memory at a synchronisation unless told to keep it).
fn after_sync(ctx: &Context, mut f: impl FnMut() -> nnfuse::Result<()>) -> nnfuse::Result<f64> {
    for _ in 0..5 {
        f()?;
    }
    queue_us(ctx, f)
}

/// Host µs per call of `f` (median over rounds) and the GPU µs of one call.
fn measure(ctx: &Context, mut f: impl FnMut() -> nnfuse::Result<()>) -> nnfuse::Result<(f64, f64)> {
    for _ in 0..20 {
        f()?;
    }
    ctx.synchronize()?;
    let host = loop_us(ctx, &mut f, CALLS, ROUNDS)?;
    Ok((host, gpu_us(ctx, f, 20.0)?))
}

fn row(what: &str, r: nnfuse::Result<(f64, f64)>) {
    match r {
        Ok((host, gpu)) => {
            println!("| {what} | {host:.1} | {gpu:.1} |");
            println!(
                "{{\"bench\":\"host_overhead\",\"case\":\"{what}\",\"host_us\":{host:.2},\"gpu_us\":{gpu:.2}}}"
            );
        }
        Err(e) => println!("| {what} | error: {e} | - |"),
    }
}

/// The buffers of one BatchNorm+ReLU training step on an NHWC f16 tensor (C last), and the step.
struct BnStep {
    x: CudaSlice<f16>,
    dy: CudaSlice<f16>,
    y: CudaSlice<f16>,
    dx: CudaSlice<f16>,
    gamma: CudaSlice<f32>,
    beta: CudaSlice<f32>,
    rm: CudaSlice<f32>,
    rv: CudaSlice<f32>,
    dg: CudaSlice<f32>,
    db: CudaSlice<f32>,
}

impl BnStep {
    fn new(s: &Arc<CudaStream>, shape: &[usize]) -> anyhow::Result<Self> {
        let n: usize = shape.iter().product();
        let c = shape[shape.len() - 1];
        let x: Vec<f16> = (0..n)
            .map(|i| f16::from_f32((i % 7) as f32 * 0.3))
            .collect();
        Ok(Self {
            x: s.clone_htod(&x)?,
            dy: s.clone_htod(&vec![f16::from_f32(0.1); n])?,
            y: s.alloc_zeros(n)?,
            dx: s.alloc_zeros(n)?,
            gamma: s.clone_htod(&vec![1.0f32; c])?,
            beta: s.alloc_zeros(c)?,
            rm: s.alloc_zeros(c)?,
            rv: s.clone_htod(&vec![1.0f32; c])?,
            dg: s.alloc_zeros(c)?,
            db: s.alloc_zeros(c)?,
        })
    }

    /// Training forward, then backward.
    fn run(&mut self, bn: &BatchNorm<f16>) -> nnfuse::Result<()> {
        let saved = bn.forward_train(TrainArgs {
            x: self.x.as_view(),
            addend: None,
            gamma: self.gamma.as_view(),
            beta: self.beta.as_view(),
            running_mean: self.rm.as_view_mut(),
            running_var: self.rv.as_view_mut(),
            y: self.y.as_view_mut(),
            momentum: 0.1,
            eps: 1e-5,
        })?;
        bn.backward(BackwardArgs {
            x: self.x.as_view(),
            y: self.y.as_view(),
            dy: self.dy.as_view(),
            gamma: self.gamma.as_view(),
            beta: self.beta.as_view(),
            saved: &saved,
            dx: self.dx.as_view_mut(),
            d_addend: None,
            dgamma: self.dg.as_view_mut(),
            dbeta: self.db.as_view_mut(),
        })
    }
}

fn main() -> std::process::ExitCode {
    exit::finish("host_overhead", run())
}

fn run() -> anyhow::Result<()> {
    let ctx = Context::with_config(0, Config::default())?;
    let s = ctx.stream().clone();
    println!("# Host overhead per call ({CALLS} calls a round, median of {ROUNDS} rounds)\n");
    println!("{}\n", ctx.info());
    println!("| case | host µs per call | GPU µs per call |\n|---|---|---|");

    // Elementwise baseline: one kernel launch through nnfuse.
    let mut buf = s.alloc_zeros::<f16>(4096)?;
    row(
        "util::fill 4096 f16 (one launch)",
        measure(&ctx, || {
            nnfuse::internals::util::fill(&ctx, &mut buf, f16::from_f32(1.0))
        }),
    );
    let x = s.clone_htod(&vec![f16::from_f32(0.5); 4096])?;
    let mut y = s.alloc_zeros::<f16>(4096)?;
    let mut mask = s.alloc_zeros::<u32>(nnfuse::activation::mask_words(4096))?;
    row(
        "activation relu_mask_fwd 4096 f16",
        measure(&ctx, || {
            nnfuse::activation::relu_mask_fwd(&ctx, &x, &mut y, Some(&mut mask))
        }),
    );

    // GEMM: a cached tuned choice.
    let p = Problem::packed(1, 64, 64, 64);
    let a = s.clone_htod(&vec![f16::from_f32(0.01); 64 * 64])?;
    let b = s.clone_htod(&vec![f16::from_f32(0.02); 64 * 64])?;
    let mut c = s.alloc_zeros::<f16>(64 * 64)?;
    row(
        "gemm 64x64x64 f16 (tuned, cached)",
        measure(&ctx, || gemm::strided_batched(&ctx, &p, &a, &b, &mut c)),
    );

    // Convolution, every route on a tiny NHWC problem.
    let shape = shapes::square3x3(1, 16, 8, 16);
    let conv = Conv2d::<f16>::new(&ctx, &shape)?;
    let cx = s.clone_htod(&vec![f16::from_f32(0.1); shape.x_len().unwrap()])?;
    let cw = s.clone_htod(&vec![f16::from_f32(0.1); shape.w_len().unwrap()])?;
    let mut cy = s.alloc_zeros::<f16>(shape.y_len()?)?;
    row(
        "conv forward 1x16x8x8 3x3 f16 (auto, cached)",
        measure(&ctx, || conv.forward(&cx, &cw, &mut cy)),
    );
    for (name, route) in [
        ("cudnn", Route::path(ConvPath::Cudnn)),
        ("cudnn_graph", Route::path(ConvPath::CudnnGraph)),
        ("im2col_gemm", Route::path(ConvPath::Im2colGemm)),
        (
            "winograd_f4x3/tensor_core",
            Route::winograd(WinogradTile::F4x3, WinogradEngine::TensorCore),
        ),
        ("direct", Route::path(ConvPath::Direct)),
    ] {
        row(
            &format!("conv forward, forced {name}"),
            measure(&ctx, || conv.forward_with(route, &cx, &cw, &mut cy)),
        );
    }
    let mut cdw = s.alloc_zeros::<f16>(shape.w_len().unwrap())?;
    row(
        "conv backward_filter (auto, cached)",
        measure(&ctx, || conv.backward_filter(&cx, &cy, &mut cdw, false)),
    );

    // BatchNorm training forward + backward, NHWC [2, 8, 8, 64] BN+ReLU, per implementation.
    let bn_shape = [2usize, 8, 8, 64];
    for (name, config) in [
        (
            "cuDNN (fused Ex)",
            Config::default().with_bn_impl(BnImpl::Cudnn),
        ),
        ("own kernels", Config::default().with_bn_impl(BnImpl::Own)),
        (
            "cuDNN + bitmask fallback",
            Config::default()
                .with_bn_impl(BnImpl::Cudnn)
                .with_cudnn_fusion_disabled(true),
        ),
    ] {
        let c2 = ctx.with_config_override(config);
        let bn = BatchNorm::<f16>::new(&c2, &bn_shape, 3, Fuse::Relu)?;
        let mut step = BnStep::new(&s, &bn_shape)?;
        row(
            &format!("BN+ReLU train fwd+bwd 2x8x8x64 f16, {name}"),
            measure(&c2, || step.run(&bn)),
        );
    }

    // The demo's shapes, each call queued right after the GPU went idle.
    println!(
        "\n| case (ResNet-50 sizes, batch 32) | host µs to queue one call after a synchronize |\n|---|---|"
    );
    let big = |what: &str, r: nnfuse::Result<f64>| match r {
        Ok(us) => {
            println!("| {what} | {us:.1} |");
            println!(
                "{{\"bench\":\"host_overhead\",\"case\":\"{what}\",\"after_sync_us\":{us:.2}}}"
            );
        }
        Err(e) => println!("| {what} | error: {e} |"),
    };
    big(
        "util::fill 4096 f16",
        after_sync(&ctx, || {
            nnfuse::internals::util::fill(&ctx, &mut buf, f16::from_f32(1.0))
        }),
    );
    let shape = shapes::square3x3(32, 64, 56, 64);
    let conv = Conv2d::<f16>::new(&ctx, &shape)?;
    let cx = s.clone_htod(&vec![f16::from_f32(0.1); shape.x_len().unwrap()])?;
    let cw = s.clone_htod(&vec![f16::from_f32(0.01); shape.w_len().unwrap()])?;
    let mut cy = s.alloc_zeros::<f16>(shape.y_len()?)?;
    big(
        "conv forward 32x64x56x56 3x3 f16 (auto, cached)",
        after_sync(&ctx, || conv.forward(&cx, &cw, &mut cy)),
    );
    let bn_shape = [32usize, 56, 56, 64];
    for (name, config) in [
        (
            "cuDNN (fused Ex)",
            Config::default().with_bn_impl(BnImpl::Cudnn),
        ),
        ("own kernels", Config::default().with_bn_impl(BnImpl::Own)),
    ] {
        let c2 = ctx.with_config_override(config);
        let bn = BatchNorm::<f16>::new(&c2, &bn_shape, 3, Fuse::Relu)?;
        let mut step = BnStep::new(&s, &bn_shape)?;
        big(
            &format!("BN+ReLU train fwd+bwd 32x56x56x64 f16, {name}"),
            after_sync(&c2, || step.run(&bn)),
        );
    }
    let mut big_buf = s.alloc_zeros::<u8>(1)?;
    big(
        "stream alloc of 4 MiB, then free",
        after_sync(&ctx, || {
            // SAFETY: never read; dropped (freed in stream order) at the next assignment.
            big_buf = unsafe { ctx.stream().alloc::<u8>(4 << 20) }
                .map_err(|e| nnfuse::Error::NotSupported(format!("{e:?}")))?;
            Ok(())
        }),
    );
    Ok(())
}
