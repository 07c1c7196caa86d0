//! Host overhead per call: how long the host takes to validate, dispatch and queue one call of
//! each operation and route, on problems so small that the GPU keeps up with the host (so the
//! wall time of many back-to-back calls is the host's). A framework's step is host-bound when
//! these numbers exceed its kernels' GPU time.
//!
//! For each case: warm-up (first calls pay plans, searches, `auto`'s measurement, NVRTC), then
//! rounds of `CALLS` calls timed on the host without synchronising inside a round; the median
//! round gives µs per call. Next to it, in the same run: the **bare vendor call** of the same
//! work with everything prepared beforehand (`support/bare.rs`: `cudnnBackendExecute` of a plan
//! with a prebuilt variant pack, the legacy `cudnnConvolutionForward` with descriptors built
//! once, `cublasGemmStridedBatchedEx`, `cuLaunchKernel` of the same kernel), the difference
//! (nnfuse's own share; target ≤ 3 µs), the GPU time of one call (CUDA events: when it is close
//! to the host time the case is GPU-bound and the host number is an upper bound), the physical
//! floor of the work (bytes at 3.0 TB/s or FLOPs at 700 TFLOP/s), and nnfuse's host time by
//! stage from a second, profiled pass (`nnfuse::internals::profile`, µs per call; the profiled
//! pass is slower by its timers, about 50 ns per stage change, so read it as shares).
//!
//! `NNFUSE_BENCH_QUICK=1`: fewer calls and rounds (well under a minute).

#[path = "support/bare.rs"]
mod bare;
#[path = "support/chain_bufs.rs"]
mod chain_bufs;
#[path = "support/exit.rs"]
mod exit;
#[path = "support/host_time.rs"]
mod host_time;
#[path = "support/shapes.rs"]
mod shapes;

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use half::f16;
use nnfuse::batchnorm::{BackwardArgs, BatchNorm, Fuse, TrainArgs};
use nnfuse::block::{ChainRoute, ChainSaved, ConvBnChain};
use nnfuse::conv::{Conv2d, ConvPath, ConvShape, Route, WinogradEngine, WinogradTile};
use nnfuse::gemm::{self, Problem};
use nnfuse::internals::profile::{self, Stage, Totals};
use nnfuse::{BnImpl, Config, Context, CudnnApi};

use chain_bufs::Bufs;
use host_time::{gpu_us, loop_us, queue_us};

const PEAK_FLOPS: f64 = 700e12;
const PEAK_BYTES: f64 = 3.0e12;

/// (calls a round, rounds): fewer under `NNFUSE_BENCH_QUICK=1`.
fn calls_rounds() -> (usize, usize) {
    if std::env::var_os("NNFUSE_BENCH_QUICK").is_some_and(|v| v == "1") {
        (100, 3)
    } else {
        (400, 7)
    }
}

/// The physical floor in µs of work moving `bytes` and doing `flops`.
fn floor_us(bytes: f64, flops: f64) -> f64 {
    (bytes / PEAK_BYTES).max(flops / PEAK_FLOPS) * 1e6
}

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

/// nnfuse's side of a case: host µs per call, GPU µs per call, profiled stage totals and the
/// calls they cover.
struct Nn {
    host: f64,
    gpu: f64,
    stages: Totals,
    calls: usize,
}

/// Host µs per call of `f` (median over rounds, profile off), the GPU µs of one call, and one
/// profiled pass of `calls` calls for the breakdown.
fn measure(ctx: &Context, mut f: impl FnMut() -> nnfuse::Result<()>) -> nnfuse::Result<Nn> {
    let (calls, rounds) = calls_rounds();
    for _ in 0..20 {
        f()?;
    }
    ctx.synchronize()?;
    profile::set_enabled(false);
    let host = loop_us(ctx, &mut f, calls, rounds)?;
    profile::set_enabled(true);
    let _ = profile::take();
    let profiled = (0..calls).try_for_each(|_| f());
    let stages = profile::take();
    profile::set_enabled(false);
    profiled?;
    ctx.synchronize()?;
    Ok(Nn {
        host,
        gpu: gpu_us(ctx, f, 20.0)?,
        stages,
        calls,
    })
}

/// Host µs per call of a bare vendor call `f` (median over rounds).
fn measure_bare(ctx: &Context, mut f: impl FnMut() -> nnfuse::Result<()>) -> nnfuse::Result<f64> {
    let (calls, rounds) = calls_rounds();
    for _ in 0..20 {
        f()?;
    }
    ctx.synchronize()?;
    loop_us(ctx, &mut f, calls, rounds)
}

/// `name µs (entries per call)` for every stage that ran.
fn breakdown(t: &Totals, calls: usize) -> (String, String) {
    let per = |ns: u64| ns as f64 / 1e3 / calls as f64;
    let mut text = Vec::new();
    let mut json = Vec::new();
    for s in Stage::ALL {
        if t.entries_of(s) == 0 {
            continue;
        }
        let entries = t.entries_of(s) as f64 / calls as f64;
        text.push(format!(
            "{} {:.2} (x{entries:.0})",
            s.name(),
            per(t.ns_of(s))
        ));
        json.push(format!("\"{}\":{:.3}", s.name(), per(t.ns_of(s))));
    }
    (text.join(", "), format!("{{{}}}", json.join(",")))
}

/// One table row and its JSON line: nnfuse's host time, the bare vendor call's (when there is
/// one), the difference, the GPU time, the floor and the stages.
fn row(what: &str, floor: f64, nn: nnfuse::Result<Nn>, bare: Option<nnfuse::Result<f64>>) {
    let nn = match nn {
        Ok(n) => n,
        Err(e) => {
            println!("| {what} | error: {e} | - | - | - | {floor:.1} | - |");
            return;
        }
    };
    let (stages, stages_json) = breakdown(&nn.stages, nn.calls);
    let (bare_txt, share_txt, bare_json) = match bare {
        Some(Ok(b)) => (
            format!("{b:.1}"),
            format!("{:.1}", nn.host - b),
            format!(",\"bare_us\":{b:.2},\"share_us\":{:.2}", nn.host - b),
        ),
        Some(Err(e)) => (format!("error: {e}"), "-".into(), String::new()),
        None => ("(own kernels)".into(), "-".into(), String::new()),
    };
    println!(
        "| {what} | {:.1} | {bare_txt} | {share_txt} | {:.1} | {floor:.1} | {stages} |",
        nn.host, nn.gpu
    );
    println!(
        "{{\"bench\":\"host_overhead\",\"case\":\"{what}\",\"host_us\":{:.2}{bare_json},\
         \"gpu_us\":{:.2},\"floor_us\":{floor:.2},\"stages_us\":{stages_json}}}",
        nn.host, nn.gpu
    );
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
    let (calls, rounds) = calls_rounds();
    println!("# Host overhead per call ({calls} calls a round, median of {rounds} rounds)\n");
    println!("{}\n", ctx.info());
    println!("## cudarc's event tracking on (the default: the Context owns a second stream)\n");
    per_call_table(&ctx, &s)?;
    // SAFETY: every buffer of the second pass is used on the Context's stream only (what a
    // single-stream framework guarantees when it turns tracking off); tracking is restored
    // before the rows after it.
    unsafe { ctx.cuda().disable_event_tracking() };
    println!("\n## cudarc's event tracking off (a single-stream framework: docs/CAPTURE.md)\n");
    let off = per_call_table(&ctx, &s);
    // SAFETY: as above; buffers made from here on are tracked again.
    unsafe { ctx.cuda().enable_event_tracking() };
    off?;
    let mut buf = s.alloc_zeros::<f16>(4096)?;
    after_sync_rows(&ctx, &s, &mut buf)
}

/// nnfuse's host time per cached call next to the bare vendor call, one row per operation.
fn per_call_table(ctx: &Context, s: &Arc<CudaStream>) -> anyhow::Result<()> {
    let ctx = ctx.clone();
    let s = s.clone();
    println!(
        "| case | nnfuse host µs per call | bare vendor call µs | nnfuse's share µs (target ≤ 3) \
         | GPU µs per call | floor µs | nnfuse's stages, µs per call (profiled pass) |\n\
         |---|---|---|---|---|---|---|"
    );

    // Elementwise baseline: one kernel launch through nnfuse.
    let mut buf = s.alloc_zeros::<f16>(4096)?;
    row(
        "util::fill 4096 f16 (one launch)",
        floor_us(8192.0, 0.0),
        measure(&ctx, || {
            nnfuse::internals::util::fill(&ctx, &mut buf, f16::from_f32(1.0))
        }),
        None,
    );
    let x = s.clone_htod(&vec![f16::from_f32(0.5); 4096])?;
    let mut y = s.alloc_zeros::<f16>(4096)?;
    let mut mask = s.alloc_zeros::<u32>(nnfuse::activation::mask_words(4096))?;
    let nn = measure(&ctx, || {
        nnfuse::activation::relu_mask_fwd(&ctx, &x, &mut y, Some(&mut mask))
    });
    let bare = bare_relu(&ctx, &x, &mut y, &mut mask);
    row(
        "activation relu_mask_fwd 4096 f16",
        floor_us(2.0 * 8192.0 + 512.0, 0.0),
        nn,
        Some(bare),
    );

    // GEMM: a cached tuned choice, next to a bare cublasGemmStridedBatchedEx of the same problem.
    let p = Problem::packed(1, 64, 64, 64);
    let a = s.clone_htod(&vec![f16::from_f32(0.01); 64 * 64])?;
    let b = s.clone_htod(&vec![f16::from_f32(0.02); 64 * 64])?;
    let mut c = s.alloc_zeros::<f16>(64 * 64)?;
    let nn = measure(&ctx, || gemm::strided_batched(&ctx, &p, &a, &b, &mut c));
    let bare = bare_gemm(&ctx, &a, &b, &mut c);
    row(
        "gemm 64x64x64 f16 (tuned, cached)",
        floor_us(3.0 * 8192.0, 2.0 * 64f64.powi(3)),
        nn,
        Some(bare),
    );

    // Convolution, every route on a tiny NHWC problem.
    let shape = shapes::square3x3(1, 16, 8, 16);
    let conv_floor = {
        let (oh, ow) = shape.out_hw()?;
        let flops = 2.0 * (shape.n * shape.c_out * oh * ow * shape.c_in * 9) as f64;
        let bytes = 2.0 * (shape.x_len()? + shape.w_len()? + shape.y_len()?) as f64;
        floor_us(bytes, flops)
    };
    let conv = Conv2d::<f16>::new(&ctx, &shape)?;
    let cx = s.clone_htod(&vec![f16::from_f32(0.1); shape.x_len()?])?;
    let cw = s.clone_htod(&vec![f16::from_f32(0.1); shape.w_len()?])?;
    let mut cy = s.alloc_zeros::<f16>(shape.y_len()?)?;
    let nn = measure(&ctx, || conv.forward(&cx, &cw, &mut cy));
    let auto_path = conv
        .choice(nnfuse::conv::Direction::Forward)
        .map(|c| c.route.path);
    let (bare_graph, bare_legacy) = bare_convs(&ctx, &shape, &cx, &cw, &mut cy);
    let auto_bare = match auto_path {
        Some(ConvPath::CudnnGraph) => Some(clone_result(&bare_graph)),
        Some(ConvPath::Cudnn) => Some(clone_result(&bare_legacy)),
        _ => None,
    };
    row(
        &format!(
            "conv forward 1x16x8x8 3x3 f16 (auto, cached: {})",
            auto_path.map_or("?".into(), |p| p.to_string())
        ),
        conv_floor,
        nn,
        auto_bare,
    );
    for (name, route, bare) in [
        (
            "cudnn (legacy)",
            Route::path(ConvPath::Cudnn),
            Some(clone_result(&bare_legacy)),
        ),
        (
            "cudnn_graph",
            Route::path(ConvPath::CudnnGraph),
            Some(clone_result(&bare_graph)),
        ),
        ("im2col_gemm", Route::path(ConvPath::Im2colGemm), None),
        (
            "winograd_f4x3/tensor_core",
            Route::winograd(WinogradTile::F4x3, WinogradEngine::TensorCore),
            None,
        ),
        ("direct", Route::path(ConvPath::Direct), None),
    ] {
        row(
            &format!("conv forward, forced {name}"),
            conv_floor,
            measure(&ctx, || conv.forward_with(route, &cx, &cw, &mut cy)),
            bare,
        );
    }
    // The graph route's execution replayed (above: the default) against executed every call.
    let eager_ctx = ctx.with_config_override(ctx.config().clone().with_cudnn_replay(false));
    let eager_conv = Conv2d::<f16>::new(&eager_ctx, &shape)?;
    row(
        "conv forward, forced cudnn_graph, replay off",
        conv_floor,
        measure(&eager_ctx, || {
            eager_conv.forward_with(Route::path(ConvPath::CudnnGraph), &cx, &cw, &mut cy)
        }),
        Some(clone_result(&bare_graph)),
    );
    let mut cdw = s.alloc_zeros::<f16>(shape.w_len()?)?;
    row(
        "conv backward_filter (auto, cached)",
        conv_floor,
        measure(&ctx, || conv.backward_filter(&cx, &cy, &mut cdw, false)),
        None,
    );

    // BatchNorm training forward + backward, NHWC [2, 8, 8, 64] BN+ReLU, per implementation.
    // (The bare legacy Ex pair is not in this bench yet: see the report.)
    let bn_shape = [2usize, 8, 8, 64];
    let bn_floor = floor_us(2.0 * 5.0 * (2 * 8 * 8 * 64) as f64, 0.0);
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
            bn_floor,
            measure(&c2, || step.run(&bn)),
            None,
        );
    }

    // BatchNorm through cuDNN's graph API (NNFUSE_CUDNN_API=graph) against the legacy Ex pair,
    // plain BN and BN+ReLU (graph BN + nnfuse's bitmask kernels). Target: the graph's plain
    // fwd+bwd at least 1.5x cheaper on the host than the legacy Ex pair (issue 19).
    // The calls repeat with the same buffers here: executed every call (Config::cudnn_replay
    // off, the default: the legacy Ex pair so is the baseline, cuDNN's own cost), and replayed
    // from CUDA graphs captured at their second call (replay on, opt-in: docs/CUDNN-GRAPH.md).
    let mut plain = [None, None, None, None];
    for (i, (name, api, fuse, replay)) in [
        ("legacy Ex, replay off", CudnnApi::Legacy, Fuse::None, false),
        ("legacy Ex (replayed)", CudnnApi::Legacy, Fuse::None, true),
        ("graph API (replayed)", CudnnApi::Graph, Fuse::None, true),
        ("graph API, replay off", CudnnApi::Graph, Fuse::None, false),
        (
            "graph API + bitmask ReLU",
            CudnnApi::Graph,
            Fuse::Relu,
            true,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let config = Config::default()
            .with_bn_impl(BnImpl::Cudnn)
            .with_cudnn_api(api)
            .with_cudnn_replay(replay);
        let c2 = ctx.with_config_override(config);
        let bn = BatchNorm::<f16>::new(&c2, &bn_shape, 3, fuse)?;
        let mut step = BnStep::new(&s, &bn_shape)?;
        let m = measure(&c2, || step.run(&bn));
        if let (Some(slot), Ok(m)) = (plain.get_mut(i), &m) {
            *slot = Some(m.host);
        }
        row(
            &format!(
                "BN {} train fwd+bwd 2x8x8x64 f16, cuDNN {name}",
                fuse.describe()
            ),
            bn_floor,
            m,
            None,
        );
    }
    if let [Some(legacy), Some(legacy_replayed), Some(graph), Some(graph_executed)] = plain {
        println!(
            "BN plain fwd+bwd host: legacy Ex pair executed {legacy:.1} µs, graph API replayed \
             {graph:.1} µs: {:.2}x (target >= 1.5x); graph executed {graph_executed:.1} µs \
             ({:.2}x); legacy replayed {legacy_replayed:.1} µs ({:.2}x)",
            legacy / graph,
            legacy / graph_executed,
            legacy / legacy_replayed,
        );
    }
    captured_bn_rows(&ctx, &s, &bn_shape, bn_floor)?;
    chain_rows(&ctx);
    Ok(())
}

/// The same plain BatchNorm forward + backward captured once into a CUDA graph
/// (`Context::capture`, docs/CAPTURE.md) and replayed: the host time per step of a framework
/// that captures its step, per cuDNN API. Capture needs cudarc's event tracking off: with it on
/// the row says so instead.
fn captured_bn_rows(
    ctx: &Context,
    s: &Arc<CudaStream>,
    shape: &[usize],
    floor: f64,
) -> anyhow::Result<()> {
    for (name, api) in [
        ("legacy Ex", CudnnApi::Legacy),
        ("graph API", CudnnApi::Graph),
    ] {
        let config = Config::default()
            .with_bn_impl(BnImpl::Cudnn)
            .with_cudnn_api(api);
        let c2 = ctx.with_config_override(config);
        let bn = BatchNorm::<f16>::new(&c2, shape, 3, Fuse::None)?;
        let mut step = BnStep::new(s, shape)?;
        let case =
            format!("BN plain train fwd+bwd 2x8x8x64 f16, cuDNN {name}, captured (one replay)");
        // The first call plans, allocates and decides: never inside a capture.
        step.run(&bn)?;
        c2.synchronize()?;
        match c2.capture(|_| step.run(&bn)) {
            Ok(g) => row(&case, floor, measure(&c2, || g.replay()), None),
            Err(e) => println!("| {case} | not captured: {e} | | | | | |"),
        }
    }
    Ok(())
}

/// The training chain (the demo's bottleneck at n 2, 8x8, f16 NHWC: three units, the shortcut
/// into dx) per route forced: host µs of one forward + backward, the units route (three
/// `ConvBnTrain` calls each way) against the prologue route (cuDNN graphs and nnfuse's kernels).
fn chain_rows(ctx: &Context) {
    for route in ChainRoute::ALL {
        let what = format!("ConvBnChain fwd+bwd bottleneck 2x8x8 f16, {route} route");
        match ChainCase::new(ctx) {
            Ok(mut c) if c.chain.plan().eligible(route) => {
                let m = measure(ctx, || c.step(route));
                row(&what, 0.0, m, None);
            }
            Ok(c) => println!(
                "| {what} | refused: {} | - | - | - | - | - |",
                c.chain.plan().reason(route)
            ),
            Err(e) => println!("| {what} | error: {e} | - | - | - | - | - |"),
        }
    }
}

/// One chain and its buffers.
struct ChainCase {
    chain: ConvBnChain<f16>,
    saved: ChainSaved<f16>,
    bufs: Bufs<f16>,
}

impl ChainCase {
    fn new(ctx: &Context) -> anyhow::Result<ChainCase> {
        let sh = |c, k, r| ConvShape::square(2, c, 8, k, r, nnfuse::TensorFormat::Nhwc);
        let shapes = [sh(256, 64, 1), sh(64, 64, 3), sh(64, 256, 1)];
        let chain = ConvBnChain::<f16>::new(ctx, &shapes, Fuse::AddRelu)?;
        Ok(ChainCase {
            saved: chain.new_saved()?,
            bufs: Bufs::new(ctx, &shapes)?,
            chain,
        })
    }

    /// One forward and its backward on `route`.
    fn step(&mut self, route: ChainRoute) -> nnfuse::Result<()> {
        self.chain
            .forward_train_with(route, self.bufs.fwd(), &mut self.saved)?;
        self.chain.backward(self.bufs.bwd(), &mut self.saved)
    }
}

/// The demo's shapes, each call queued right after the GPU went idle, and the memory pool's
/// part in it.
fn after_sync_rows(
    ctx: &Context,
    s: &Arc<CudaStream>,
    buf: &mut CudaSlice<f16>,
) -> anyhow::Result<()> {
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
        after_sync(ctx, || {
            nnfuse::internals::util::fill(ctx, buf, f16::from_f32(1.0))
        }),
    );
    let shape = shapes::square3x3(32, 64, 56, 64);
    let conv = Conv2d::<f16>::new(ctx, &shape)?;
    let cx = s.clone_htod(&vec![f16::from_f32(0.1); shape.x_len()?])?;
    let cw = s.clone_htod(&vec![f16::from_f32(0.01); shape.w_len()?])?;
    let mut cy = s.alloc_zeros::<f16>(shape.y_len()?)?;
    big(
        "conv forward 32x64x56x56 3x3 f16 (auto, cached)",
        after_sync(ctx, || conv.forward(&cx, &cw, &mut cy)),
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
        let mut step = BnStep::new(s, &bn_shape)?;
        big(
            &format!("BN+ReLU train fwd+bwd 32x56x56x64 f16, {name}"),
            after_sync(&c2, || step.run(&bn)),
        );
    }
    // Hypothesis for the lead to confirm: CUDA's default memory pool has a release threshold of
    // 0, so at every synchronize it returns its unused memory to the OS; the next 4 MiB
    // cuMemAllocAsync then has to map fresh memory (tens of µs) unless a chunk the pool kept has
    // room. With the threshold raised the pool keeps its memory across synchronizations and the
    // allocation is a pool hit (~1 µs). nnfuse leaves the pool's settings alone (a process-wide
    // choice for the framework); nnfuse's own cached calls allocate nothing.
    let mut big_buf = s.alloc_zeros::<u8>(1)?;
    let mut alloc_free = || {
        // SAFETY: never read; dropped (freed in stream order) at the next assignment.
        big_buf = unsafe { ctx.stream().alloc::<u8>(4 << 20) }
            .map_err(|e| nnfuse::Error::NotSupported(format!("{e:?}")))?;
        Ok(())
    };
    big(
        "stream alloc of 4 MiB, then free (pool release threshold 0, CUDA's default)",
        after_sync(ctx, &mut alloc_free),
    );
    match bare::set_default_pool_release_threshold(ctx, u64::MAX) {
        Ok(()) => {
            big(
                "stream alloc of 4 MiB, then free (pool release threshold raised to u64::MAX)",
                after_sync(ctx, &mut alloc_free),
            );
            bare::set_default_pool_release_threshold(ctx, 0)?;
        }
        Err(e) => println!("| pool release threshold | error: {e} |"),
    }
    Ok(())
}

fn clone_result(r: &nnfuse::Result<f64>) -> nnfuse::Result<f64> {
    match r {
        Ok(v) => Ok(*v),
        Err(e) => Err(nnfuse::Error::NotSupported(e.to_string())),
    }
}

/// Bare `cuLaunchKernel` of nnfuse's `relu_mask_fwd_f16` on the same buffers (grid as nnfuse
/// sizes it, one block per SM at most).
fn bare_relu(
    ctx: &Context,
    x: &CudaSlice<f16>,
    y: &mut CudaSlice<f16>,
    mask: &mut CudaSlice<u32>,
) -> nnfuse::Result<f64> {
    use nnfuse::internals::activation::{choose_path, launch_grid, Scheme};
    let f = ctx.function(&nnfuse::internals::kernels::BITMASK, "relu_mask_fwd_f16")?;
    let st = ctx.stream();
    let (xp, _g1) = x.device_ptr(st);
    let (yp, _g2) = y.device_ptr_mut(st);
    let (mp, _g3) = mask.device_ptr_mut(st);
    let n = 4096u64;
    let sms = ctx.info().sm_count.max(1) as u32;
    let g = launch_grid(Scheme::Warp, choose_path(&[xp, yp]), n, 2, sms, 1);
    let (mut a0, mut a1, mut a2, mut a3) = (xp, yp, mp, n);
    measure_bare(ctx, || {
        let mut params = [
            &mut a0 as *mut u64 as *mut std::ffi::c_void,
            &mut a1 as *mut u64 as *mut std::ffi::c_void,
            &mut a2 as *mut u64 as *mut std::ffi::c_void,
            &mut a3 as *mut u64 as *mut std::ffi::c_void,
        ];
        // SAFETY: (x, y, mask, n) is the kernel's signature; the buffers hold n elements and
        // mask_words(n) words and outlive the measurement.
        unsafe { bare::launch(ctx, f.cu_function(), g.blocks, g.threads, &mut params) }
    })
}

/// Bare `cublasGemmStridedBatchedEx` of the 64^3 f16 problem on the same buffers.
fn bare_gemm(
    ctx: &Context,
    a: &CudaSlice<f16>,
    b: &CudaSlice<f16>,
    c: &mut CudaSlice<f16>,
) -> nnfuse::Result<f64> {
    let h = ctx.lock()?.cublas()?;
    let st = ctx.stream();
    let (ap, _g1) = a.device_ptr(st);
    let (bp, _g2) = b.device_ptr(st);
    let (cp, _g3) = c.device_ptr_mut(st);
    // SAFETY: the handle is bound to the Context's stream; one thread; packed 64^3 operands.
    measure_bare(ctx, || unsafe {
        bare::gemm_f16(h, 64, 64, 64, 1, ap, bp, cp)
    })
}

/// The bare convolutions of the problem on the buffers' device addresses: the graph plan's
/// `cudnnBackendExecute` and the legacy `cudnnConvolutionForward`, in that order.
fn bare_convs(
    ctx: &Context,
    shape: &nnfuse::conv::ConvShape,
    x: &CudaSlice<f16>,
    w: &CudaSlice<f16>,
    y: &mut CudaSlice<f16>,
) -> (nnfuse::Result<f64>, nnfuse::Result<f64>) {
    let st = ctx.stream();
    let (px, _a) = x.device_ptr(st);
    let (pw, _b) = w.device_ptr(st);
    let (py, _c) = y.device_ptr_mut(st);
    (
        bare_graph_execute(ctx, shape, [px, pw, py]),
        bare_legacy_conv(ctx, shape, [px, pw, py]),
    )
}

/// Bare `cudnnBackendExecute` of a graph plan of the problem with a variant pack built once
/// (`ptrs`: x, w, y).
fn bare_graph_execute(
    ctx: &Context,
    shape: &nnfuse::conv::ConvShape,
    ptrs: [u64; 3],
) -> nnfuse::Result<f64> {
    use nnfuse::internals::cudnn_graph::{execute, GraphConv, GraphConvKey, VariantPack};
    let plan = GraphConv::cached(
        ctx,
        GraphConvKey::new(*shape, nnfuse::DType::F16, nnfuse::conv::Direction::Forward),
    )?;
    let (h, ws) = {
        let mut g = ctx.lock()?;
        (g.cudnn()?, g.workspace(plan.workspace_bytes())?)
    };
    let pack = VariantPack::new(ptrs, ws)?;
    // SAFETY: buffers and workspace outlive the measurement; one thread; the Context's stream.
    measure_bare(ctx, || unsafe { execute(h, plan.plan(), &pack) })
}

/// Bare legacy `cudnnConvolutionForward` with descriptors built once (`ptrs`: x, w, y).
fn bare_legacy_conv(
    ctx: &Context,
    shape: &nnfuse::conv::ConvShape,
    [px, pw, py]: [u64; 3],
) -> nnfuse::Result<f64> {
    let legacy = bare::LegacyConv::new(ctx, shape)?;
    // SAFETY: the buffers hold the problem and outlive the measurement; one thread.
    measure_bare(ctx, || unsafe { legacy.run(px, pw, py) })
}
