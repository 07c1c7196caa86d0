//! CUDA-graph capture of nnfuse calls (`Context::capture`, docs/CAPTURE.md): a training-like
//! sequence (convolution forward and both gradients in f16 NHWC and f32 NCHW, BatchNorm+ReLU and
//! BatchNorm+Add+ReLU training forward and backward on cuDNN and on nnfuse's own kernels, GEMMs
//! on the tuned and the cuBLAS-default routes, a bitmask ReLU) captured after warm-up calls and
//! replayed with fresh inputs, bit-identical to eager calls; and the typed refusal of calls that
//! are not decided yet, after which the stream is usable. Ignored without a GPU, except the
//! message test.
//!
//! The tests of this file run one at a time: a capture runs in CUDA's global capture mode, in
//! which a potentially unsafe call (a module load, a synchronous allocation) of another thread
//! fails while it lasts.

mod common;

use std::sync::Mutex;

use common::*;
use cudarc::driver::CudaSlice;
use half::f16;
use nnfuse::batchnorm::{BackwardArgs, BatchNorm, Fuse, TrainArgs};
use nnfuse::conv::{Conv2d, ConvShape};
use nnfuse::gemm::{self, Problem};
use nnfuse::internals::util::fill;
use nnfuse::reference::activation::mask_words;
use nnfuse::{activation, BnImpl, Config, Context, Element, Error, TensorFormat};

/// One capture test at a time (see the module docs).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

/// A Context ready for capture: cudarc's per-buffer events off (the test orders everything on
/// the Context's one stream). Deterministic, so that two eager runs agree bit for bit too.
fn capture_ctx() -> Context {
    let ctx = gpu_with(Config::default().with_deterministic(true));
    // SAFETY: every buffer of these tests is used on ctx's stream only.
    unsafe { ctx.cuda().disable_event_tracking() };
    ctx
}

fn conv_shape(n: usize, c_in: usize, h: usize, c_out: usize, format: TensorFormat) -> ConvShape {
    square_conv(n, c_in, h, c_out, 3, format)
}

/// A device buffer of `T` the test writes inputs into.
fn zeros<T: Element>(ctx: &Context, n: usize) -> CudaSlice<T> {
    ctx.stream().alloc_zeros::<T>(n).unwrap()
}

/// One convolution's buffers: forward, data gradient and filter gradient.
struct ConvPart<T: Element> {
    conv: Conv2d<T>,
    x: CudaSlice<T>,
    w: CudaSlice<T>,
    dy: CudaSlice<T>,
    y: CudaSlice<T>,
    dx: CudaSlice<T>,
    dw: CudaSlice<T>,
}

impl<T: Element> ConvPart<T> {
    fn new(ctx: &Context, s: &ConvShape) -> Self {
        let (xl, wl, yl) = (s.x_len().unwrap(), s.w_len().unwrap(), s.y_len().unwrap());
        ConvPart {
            conv: Conv2d::new(ctx, s).unwrap(),
            x: zeros(ctx, xl),
            w: zeros(ctx, wl),
            dy: zeros(ctx, yl),
            y: zeros(ctx, yl),
            dx: zeros(ctx, xl),
            dw: zeros(ctx, wl),
        }
    }

    fn run(&mut self) -> nnfuse::Result<()> {
        self.conv.forward(&self.x, &self.w, &mut self.y)?;
        self.conv.backward_data(&self.dy, &self.w, &mut self.dx)?;
        self.conv
            .backward_filter(&self.x, &self.dy, &mut self.dw, false)
    }

    fn write_inputs(&mut self, ctx: &Context, rng: &mut Rng) {
        let s = ctx.stream();
        for b in [&mut self.x, &mut self.w, &mut self.dy] {
            s.memcpy_htod(&rng.vec::<T>(b.len(), -1.0, 1.0), b).unwrap();
        }
    }

    fn poison(&mut self, ctx: &Context) {
        for b in [&mut self.y, &mut self.dx, &mut self.dw] {
            fill(ctx, b, T::from_f64(f64::NAN)).unwrap();
        }
    }

    fn outputs(&self, ctx: &Context, tag: &str, out: &mut Vec<(String, Vec<u64>)>) {
        for (name, b) in [("y", &self.y), ("dx", &self.dx), ("dw", &self.dw)] {
            out.push((format!("{tag} {name}"), bits(ctx, b)));
        }
    }
}

/// One BatchNorm's buffers: training forward then backward.
struct BnPart<T: Element> {
    bn: BatchNorm<T>,
    add: bool,
    x: CudaSlice<T>,
    z: CudaSlice<T>,
    dy: CudaSlice<T>,
    gamma: CudaSlice<f32>,
    beta: CudaSlice<f32>,
    rm: CudaSlice<f32>,
    rv: CudaSlice<f32>,
    y: CudaSlice<T>,
    dx: CudaSlice<T>,
    dz: CudaSlice<T>,
    dg: CudaSlice<f32>,
    db: CudaSlice<f32>,
}

impl<T: Element> BnPart<T> {
    fn new(ctx: &Context, shape: &[usize], axis: usize, fuse: Fuse) -> Self {
        let n: usize = shape.iter().product();
        let c = shape[axis];
        BnPart {
            bn: BatchNorm::new(ctx, shape, axis, fuse).unwrap(),
            add: fuse == Fuse::AddRelu,
            x: zeros(ctx, n),
            z: zeros(ctx, n),
            dy: zeros(ctx, n),
            gamma: zeros(ctx, c),
            beta: zeros(ctx, c),
            rm: zeros(ctx, c),
            rv: zeros(ctx, c),
            y: zeros(ctx, n),
            dx: zeros(ctx, n),
            dz: zeros(ctx, n),
            dg: zeros(ctx, c),
            db: zeros(ctx, c),
        }
    }

    /// Forward and backward; the saved state is made and dropped inside (under capture: graph
    /// memory allocated and freed by the graph).
    fn run(&mut self) -> nnfuse::Result<()> {
        let saved = self.bn.forward_train(TrainArgs {
            x: self.x.as_view(),
            addend: self.add.then(|| self.z.as_view()),
            gamma: self.gamma.as_view(),
            beta: self.beta.as_view(),
            running_mean: self.rm.as_view_mut(),
            running_var: self.rv.as_view_mut(),
            y: self.y.as_view_mut(),
            momentum: 0.1,
            eps: 1e-5,
        })?;
        self.bn.backward(BackwardArgs {
            x: self.x.as_view(),
            y: self.y.as_view(),
            dy: self.dy.as_view(),
            gamma: self.gamma.as_view(),
            beta: self.beta.as_view(),
            saved: &saved,
            dx: self.dx.as_view_mut(),
            d_addend: self.add.then(|| self.dz.as_view_mut()),
            dgamma: self.dg.as_view_mut(),
            dbeta: self.db.as_view_mut(),
        })
    }

    /// Fresh activations, parameters and running statistics (the running statistics are
    /// updated in place, so each round starts them from its own values).
    fn write_inputs(&mut self, ctx: &Context, rng: &mut Rng) {
        let s = ctx.stream();
        for b in [&mut self.x, &mut self.z, &mut self.dy] {
            s.memcpy_htod(&rng.vec::<T>(b.len(), -2.0, 2.0), b).unwrap();
        }
        for (b, lo, hi) in [
            (&mut self.gamma, 0.5, 1.5),
            (&mut self.beta, -0.5, 0.5),
            (&mut self.rm, -0.1, 0.1),
            (&mut self.rv, 0.5, 1.5),
        ] {
            s.memcpy_htod(&rng.vec::<f32>(b.len(), lo, hi), b).unwrap();
        }
    }

    fn poison(&mut self, ctx: &Context) {
        for b in [&mut self.y, &mut self.dx, &mut self.dz] {
            fill(ctx, b, T::from_f64(f64::NAN)).unwrap();
        }
        for b in [&mut self.dg, &mut self.db] {
            fill(ctx, b, f32::NAN).unwrap();
        }
    }

    fn outputs(&self, ctx: &Context, tag: &str, out: &mut Vec<(String, Vec<u64>)>) {
        for (name, b) in [("y", &self.y), ("dx", &self.dx)] {
            out.push((format!("{tag} {name}"), bits(ctx, b)));
        }
        if self.add {
            out.push((format!("{tag} dz"), bits(ctx, &self.dz)));
        }
        for (name, b) in [
            ("dgamma", &self.dg),
            ("dbeta", &self.db),
            ("running_mean", &self.rm),
            ("running_var", &self.rv),
        ] {
            out.push((format!("{tag} {name}"), bits(ctx, b)));
        }
    }
}

/// One GEMM's buffers.
struct GemmPart<T: Element> {
    p: Problem,
    a: CudaSlice<T>,
    b: CudaSlice<T>,
    c: CudaSlice<T>,
}

impl<T: Element> GemmPart<T> {
    fn new(ctx: &Context, batch: usize, m: usize, n: usize, k: usize) -> Self {
        GemmPart {
            p: Problem::packed(batch, m, n, k),
            a: zeros(ctx, batch * m * k),
            b: zeros(ctx, batch * k * n),
            c: zeros(ctx, batch * m * n),
        }
    }

    fn run(&mut self, ctx: &Context) -> nnfuse::Result<()> {
        gemm::strided_batched(ctx, &self.p, &self.a, &self.b, &mut self.c)
    }

    fn write_inputs(&mut self, ctx: &Context, rng: &mut Rng) {
        let s = ctx.stream();
        for b in [&mut self.a, &mut self.b] {
            s.memcpy_htod(&rng.vec::<T>(b.len(), -1.0, 1.0), b).unwrap();
        }
    }

    fn poison(&mut self, ctx: &Context) {
        fill(ctx, &mut self.c, T::from_f64(f64::NAN)).unwrap();
    }
}

/// Everything one step runs, on `ctx` and on two Contexts sharing its stream (own BatchNorm
/// kernels; the cuBLAS default GEMM without a search).
struct Step {
    ctx: Context,
    own: Context,
    plain_gemm: Context,
    conv_h: ConvPart<f16>,
    conv_f: ConvPart<f32>,
    bn_cudnn: BnPart<f16>,
    bn_own: BnPart<f32>,
    gemm_tuned: GemmPart<f16>,
    gemm_default: GemmPart<f32>,
    act_x: CudaSlice<f32>,
    act_y: CudaSlice<f32>,
    act_mask: CudaSlice<u32>,
    act_dx: CudaSlice<f32>,
}

impl Step {
    fn new(ctx: &Context) -> Step {
        let own = ctx.with_config_override(
            Config::default()
                .with_deterministic(true)
                .with_bn_impl(BnImpl::Own),
        );
        let plain_gemm = ctx.with_config_override(Config::default().with_gemm_search(false));
        let n_act = 3000;
        Step {
            conv_h: ConvPart::new(ctx, &conv_shape(4, 32, 16, 32, TensorFormat::Nhwc)),
            conv_f: ConvPart::new(ctx, &conv_shape(2, 16, 12, 24, TensorFormat::Nchw)),
            bn_cudnn: BnPart::new(ctx, &[8, 14, 14, 32], 3, Fuse::Relu),
            bn_own: BnPart::new(&own, &[4, 24, 10, 10], 1, Fuse::AddRelu),
            gemm_tuned: GemmPart::new(ctx, 2, 64, 48, 32),
            gemm_default: GemmPart::new(&plain_gemm, 3, 40, 24, 56),
            act_x: zeros(ctx, n_act),
            act_y: zeros(ctx, n_act),
            act_mask: ctx.stream().alloc_zeros(mask_words(n_act)).unwrap(),
            act_dx: zeros(ctx, n_act),
            ctx: ctx.clone(),
            own,
            plain_gemm,
        }
    }

    /// The step: what is captured, and what the eager runs do.
    fn run(&mut self) -> nnfuse::Result<()> {
        self.conv_h.run()?;
        self.conv_f.run()?;
        self.bn_cudnn.run()?;
        self.bn_own.run()?;
        self.gemm_tuned.run(&self.ctx)?;
        self.gemm_default.run(&self.plain_gemm)?;
        activation::relu_mask_fwd(
            &self.ctx,
            &self.act_x,
            &mut self.act_y,
            Some(&mut self.act_mask),
        )?;
        // The gradient of the ReLU, fed its own output as dy.
        activation::relu_mask_bwd(&self.ctx, &self.act_y, &self.act_mask, &mut self.act_dx)
    }

    /// Round `round`'s inputs (the same for an eager run and a replay of that round).
    fn write_inputs(&mut self, round: u64) {
        let ctx = self.ctx.clone();
        let mut rng = Rng::new(0xCA97_0000 + round);
        self.conv_h.write_inputs(&ctx, &mut rng);
        self.conv_f.write_inputs(&ctx, &mut rng);
        self.bn_cudnn.write_inputs(&ctx, &mut rng);
        self.bn_own.write_inputs(&ctx, &mut rng);
        self.gemm_tuned.write_inputs(&ctx, &mut rng);
        self.gemm_default.write_inputs(&ctx, &mut rng);
        let v = rng.vec::<f32>(self.act_x.len(), -1.0, 1.0);
        ctx.stream().memcpy_htod(&v, &mut self.act_x).unwrap();
    }

    fn poison(&mut self) {
        let ctx = self.ctx.clone();
        self.conv_h.poison(&ctx);
        self.conv_f.poison(&ctx);
        self.bn_cudnn.poison(&ctx);
        self.bn_own.poison(&ctx);
        self.gemm_tuned.poison(&ctx);
        self.gemm_default.poison(&ctx);
        fill(&ctx, &mut self.act_y, f32::NAN).unwrap();
        fill(&ctx, &mut self.act_dx, f32::NAN).unwrap();
        nnfuse::internals::util::fill_u32(&ctx, &mut self.act_mask, 0xDEAD_BEEF).unwrap();
    }

    /// Every output as bits, named.
    fn outputs(&self) -> Vec<(String, Vec<u64>)> {
        let ctx = &self.ctx;
        ctx.synchronize().unwrap();
        let mut out = Vec::new();
        self.conv_h.outputs(ctx, "conv f16 NHWC", &mut out);
        self.conv_f.outputs(ctx, "conv f32 NCHW", &mut out);
        self.bn_cudnn.outputs(ctx, "BN+ReLU cuDNN f16", &mut out);
        self.bn_own.outputs(ctx, "BN+Add+ReLU own f32", &mut out);
        out.push(("GEMM tuned f16".into(), bits(ctx, &self.gemm_tuned.c)));
        out.push(("GEMM default f32".into(), bits(ctx, &self.gemm_default.c)));
        out.push(("ReLU y".into(), bits(ctx, &self.act_y)));
        let mask = ctx.stream().clone_dtoh(&self.act_mask).unwrap();
        out.push(("ReLU mask".into(), mask.iter().map(|&w| w as u64).collect()));
        out.push(("ReLU dx".into(), bits(ctx, &self.act_dx)));
        out
    }
}

/// A buffer's elements as bit patterns (of their exact f64 values).
fn bits<T: Element>(ctx: &Context, b: &CudaSlice<T>) -> Vec<u64> {
    download(ctx, b)
        .iter()
        .map(|v| v.to_f64().to_bits())
        .collect()
}

/// Asserts `got` equals `want` output by output, bit for bit, naming the first difference.
fn assert_same(what: &str, got: &[(String, Vec<u64>)], want: &[(String, Vec<u64>)]) {
    assert_eq!(got.len(), want.len());
    for ((name, g), (_, w)) in got.iter().zip(want) {
        assert_eq!(g.len(), w.len(), "{what}: {name} length");
        if let Some(i) = (0..g.len()).find(|&i| g[i] != w[i]) {
            let diff = (0..g.len()).filter(|&i| g[i] != w[i]).count();
            panic!(
                "{what}: {name} differs at {i} ({:#x} vs {:#x}; {diff} of {} elements)",
                g[i],
                w[i],
                g.len()
            );
        }
    }
}

/// A captured step replays bit-identical to eager runs of the same step on the same inputs, with
/// fresh inputs written into the same buffers between replays; growing the workspace and
/// releasing the scratch after the capture does not disturb the graph (it keeps what it uses).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_captured_step_replays_bit_identical_to_eager_calls() {
    let _one = serial();
    let ctx = capture_ctx();
    let mut step = Step::new(&ctx);
    // Warm-up: every decision (measurements, kernels, workspace, scratch) made eagerly.
    step.write_inputs(1000);
    step.run().unwrap();
    step.run().unwrap();

    const ROUNDS: u64 = 4;
    let mut eager = Vec::new();
    for round in 0..ROUNDS {
        step.write_inputs(round);
        step.poison();
        step.run().unwrap();
        eager.push(step.outputs());
    }
    // Control: eager itself is reproducible on these inputs (else the comparison means nothing).
    step.write_inputs(0);
    step.poison();
    step.run().unwrap();
    assert_same("a second eager run of round 0", &step.outputs(), &eager[0]);

    let graph = ctx.capture(|_| step.run()).unwrap();
    graph.upload().unwrap();
    // The step's convolution, BatchNorm and GEMM each launch at least one kernel.
    let (kernels, other) = graph.node_counts().unwrap();
    assert!(kernels >= 3, "{kernels} kernel nodes, {other} others");
    // After the capture: the arenas the graph uses must survive growth and release.
    let big = 512 << 20;
    ctx.reserve_workspace(big).unwrap();
    ctx.release_scratch();
    step.own.release_scratch();
    for (round, want) in eager.iter().enumerate() {
        step.write_inputs(round as u64);
        step.poison();
        graph.replay().unwrap();
        assert_same(&format!("replay of round {round}"), &step.outputs(), want);
    }
    // Replays back to back, then one checked.
    step.write_inputs(2);
    step.poison();
    for _ in 0..5 {
        graph.replay().unwrap();
    }
    let after = step.outputs();
    // BatchNorm moved its running statistics five times; the other outputs are round 2's.
    for ((name, g), (_, w)) in after.iter().zip(&eager[2]) {
        if !name.contains("running_") {
            assert_eq!(g, w, "five replays of round 2: {name}");
        }
    }
    drop(graph);
    // The stream is usable eagerly after the graph is gone.
    step.write_inputs(3);
    step.poison();
    step.run().unwrap();
    assert_same("eager after the graph", &step.outputs(), &eager[3]);
}

/// A call whose decision is not made yet (the first call of a new convolution problem; a GEMM
/// never searched) is refused inside a capture with the typed error; the capture is discarded,
/// the stream is usable, and the following eager call decides and is correct.
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_undecided_call_under_capture_is_refused_and_the_stream_stays_usable() {
    let _one = serial();
    let ctx = capture_ctx();
    // A shape no other test uses, so that no process-wide cache has decided it.
    let s = conv_shape(3, 20, 13, 28, TensorFormat::Nhwc);
    let mut part = ConvPart::<f16>::new(&ctx, &s);
    let mut rng = Rng::fresh("an_undecided_call_under_capture_is_refused");
    part.write_inputs(&ctx, &mut rng);
    part.poison(&ctx);

    let e = ctx
        .capture(|_| part.conv.forward(&part.x, &part.w, &mut part.y))
        .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Capture { .. }), "{e:?}");
    assert!(
        msg.contains("first call") && msg.contains("before the capture"),
        "{msg}"
    );
    assert!(part.conv.choice(nnfuse::conv::Direction::Forward).is_none());

    // The stream is usable: the eager call decides now and is right.
    part.conv.forward(&part.x, &part.w, &mut part.y).unwrap();
    let c = part.conv.choice(nnfuse::conv::Direction::Forward).unwrap();
    let got = f64s(&download(&ctx, &part.y));
    let want = nnfuse::reference::conv::conv2d(
        &s,
        &f64s(&download(&ctx, &part.x)),
        &f64s(&download(&ctx, &part.w)),
    )
    .unwrap();
    assert_close(
        "forward after the refused capture",
        &got,
        &want,
        conv_tolerance(c.route.path, nnfuse::DType::F16),
    );

    // A GEMM never searched: refused, not remembered as the cuBLAS default.
    let mut g = GemmPart::<f16>::new(&ctx, 3, 72, 40, 24);
    g.write_inputs(&ctx, &mut rng);
    let key = gemm::key_for(&ctx, &g.p, &g.a, &g.b, &g.c).unwrap();
    let e = ctx.capture(|c| g.run(c)).unwrap_err();
    assert!(matches!(e, Error::Capture { .. }), "{e:?}");
    assert!(
        gemm::lookup(&key).is_none(),
        "a refused search left a choice"
    );
    g.run(&ctx).unwrap();
    let chosen = gemm::lookup(&key).expect("the eager call searched");
    assert_ne!(chosen.origin, gemm::Origin::Fallback, "{chosen:?}");

    // Synchronising, growing the workspace and a nested capture are refused the same way.
    let grow = 1 << 30;
    for (what, e) in [
        ("synchronize", ctx.capture(|c| c.synchronize()).unwrap_err()),
        (
            "workspace growth",
            ctx.capture(|c| c.reserve_workspace(grow)).unwrap_err(),
        ),
        (
            "nested capture",
            ctx.capture(|c| c.capture(|_| Ok(())).map(drop))
                .unwrap_err(),
        ),
    ] {
        assert!(matches!(e, Error::Capture { .. }), "{what}: {e:?}");
    }
    // An error of the closure's own discards the capture as well.
    let e = ctx
        .capture(|_| Err(Error::invalid("mine", "the caller's own error")))
        .unwrap_err();
    assert_eq!(e.argument(), Some("mine"));
    ctx.synchronize().unwrap();

    // The decided convolution captures and replays now.
    part.poison(&ctx);
    let graph = ctx
        .capture(|_| part.conv.forward(&part.x, &part.w, &mut part.y))
        .unwrap();
    graph.replay().unwrap();
    assert_close(
        "forward replayed",
        &f64s(&download(&ctx, &part.y)),
        &want,
        conv_tolerance(c.route.path, nnfuse::DType::F16),
    );
}

/// With cudarc's event tracking on (the default once a Context made its stream), a capture is
/// refused up front, saying how to turn it off; the stream stays usable.
#[test]
#[ignore = "needs a CUDA GPU"]
fn capture_with_event_tracking_on_is_refused_saying_how_to_turn_it_off() {
    let _one = serial();
    let ctx = gpu();
    assert!(ctx.cuda().is_managing_stream_synchronization());
    let e = ctx.capture(|_| Ok(())).unwrap_err();
    assert!(matches!(e, Error::Capture { .. }), "{e:?}");
    assert!(e.to_string().contains("disable_event_tracking"), "{e}");
    ctx.synchronize().unwrap();
}

/// The refusal's message names the operation, what it would have needed and the way out (CPU).
#[test]
fn the_capture_error_names_the_operation_and_the_way_out() {
    let e = Error::Capture {
        what: "a convolution's first call",
        why: "it would decide its route (measure); make the same call once before the capture"
            .into(),
    };
    assert_eq!(
        e.to_string(),
        "a convolution's first call is not capture-safe now: it would decide its route \
         (measure); make the same call once before the capture"
    );
    assert_eq!(e.argument(), None);
}
