//! cuDNN calls replayed from CUDA graphs captured at their second call with the same buffers
//! (`Config::cudnn_replay`, off by default; each test turns it on), through the graph API and the legacy calls:
//! convolutions (every direction, the filter gradient accumulating too) and BatchNorm training
//! forward and backward (plain, the Add+ReLU epilogue graph, the legacy fused Ex calls) give bit
//! for bit what executing every call gives, replays read the
//! inputs written since the capture, a changed scalar (momentum) or buffer is not replayed from
//! a stale graph, and `cudnn_replay = false` captures nothing. Every output is poisoned before
//! each call and checked against the f64 reference. Ignored without a GPU.

mod common;
mod conv_ref;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::f16;
use nnfuse::batchnorm::{BackwardArgs, BatchNorm, Fuse, TrainArgs};
use nnfuse::config::{BnImpl, Config, CudnnApi};
use nnfuse::conv::{Conv2d, ConvPath, ConvShape, Route};
use nnfuse::reference::batchnorm::{self as rb, BnShape};
use nnfuse::reference::conv::conv2d;
use nnfuse::{Context, Element, TensorFormat};
use tracing_subscriber::layer::{Context as LayerCtx, SubscriberExt};
use tracing_subscriber::Layer;

use common::{assert_close, download, f64s, gpu_with, poisoned, upload, Rng};
use conv_ref::{backward_data, backward_filter, compare, describe};

/// Counts nnfuse's replay events on this thread: captures and replays.
#[derive(Default, Clone)]
struct Counts {
    captured: Arc<AtomicUsize>,
    replayed: Arc<AtomicUsize>,
}

impl Counts {
    fn get(&self) -> (usize, usize) {
        (
            self.captured.load(Ordering::SeqCst),
            self.replayed.load(Ordering::SeqCst),
        )
    }
}

struct Message(String);

impl tracing::field::Visit for Message {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl<S: tracing::Subscriber> Layer<S> for Counts {
    fn on_event(&self, event: &tracing::Event<'_>, _: LayerCtx<'_, S>) {
        let mut m = Message(String::new());
        event.record(&mut m);
        if m.0.starts_with("cuDNN execution captured") {
            self.captured.fetch_add(1, Ordering::SeqCst);
        } else if m.0.starts_with("cuDNN execution replayed") {
            self.replayed.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Installs the counter as this thread's subscriber while the guard lives.
fn count_events() -> (Counts, tracing::subscriber::DefaultGuard) {
    let counts = Counts::default();
    let sub = tracing_subscriber::registry().with(counts.clone());
    (counts, tracing::subscriber::set_default(sub))
}

fn bits<T: Element>(ctx: &Context, b: &CudaSlice<T>) -> Vec<u64> {
    download(ctx, b)
        .iter()
        .map(|v| v.to_f64().to_bits())
        .collect()
}

/// A Context whose convolutions run cuDNN's graph route, deterministic (so that eager calls
/// and replays can be compared bit for bit).
fn graph_ctx(replay: bool) -> Context {
    api_ctx(CudnnApi::Graph, replay)
}

fn api_ctx(api: CudnnApi, replay: bool) -> Context {
    gpu_with(
        Config::default()
            .with_cudnn_api(api)
            .with_deterministic(true)
            .with_cudnn_replay(replay),
    )
}

/// Runs `call` `times` times on a poisoned output and returns each result's bits; checks the
/// first against `want` (f64) within the type's tolerance.
fn repeat<T: Element>(
    ctx: &Context,
    what: &str,
    out: &mut CudaSlice<T>,
    want: &[f64],
    times: usize,
    mut call: impl FnMut(&mut CudaSlice<T>) -> nnfuse::Result<()>,
) -> Vec<Vec<u64>> {
    let mut all = Vec::new();
    for i in 0..times {
        nnfuse::internals::util::fill(ctx, out, T::from_f64(f64::NAN)).unwrap();
        call(out).unwrap_or_else(|e| panic!("{what}: call {i}: {e}"));
        all.push(bits(ctx, out));
    }
    let got = f64s(&download(ctx, out));
    compare(what, &got, want, T::DTYPE.tolerance()).unwrap_or_else(|e| panic!("{e}"));
    all
}

fn assert_all_equal(what: &str, runs: &[Vec<u64>]) {
    for (i, r) in runs.iter().enumerate().skip(1) {
        let diff = r.iter().zip(&runs[0]).filter(|(a, b)| a != b).count();
        assert_eq!(
            diff, 0,
            "{what}: call {i} differs from the eager call at {diff} elements"
        );
    }
}

fn conv_case<T: Element>(path: ConvPath, format: TensorFormat, seed_tag: &str) {
    let (counts, _guard) = count_events();
    let api = if path == ConvPath::Cudnn {
        CudnnApi::Legacy
    } else {
        CudnnApi::Graph
    };
    let ctx = api_ctx(api, true);
    let mut rng = Rng::fresh(seed_tag);
    let s = ConvShape::square(2, 16, 8, 24, 3, format);
    let what = |d: &str| format!("{} {} {path} {d}", describe(&s), T::DTYPE);
    let conv = Conv2d::<T>::new(&ctx, &s).unwrap();
    let graph = Route::path(path);
    let (xl, wl, yl) = (s.x_len().unwrap(), s.w_len().unwrap(), s.y_len().unwrap());
    let (xh, wh, dyh) = (
        rng.vec::<T>(xl, -1.0, 1.0),
        rng.vec::<T>(wl, -1.0, 1.0),
        rng.vec::<T>(yl, -1.0, 1.0),
    );
    let (mut x, w, dy) = (upload(&ctx, &xh), upload(&ctx, &wh), upload(&ctx, &dyh));
    let (xf, wf, dyf) = (f64s(&xh), f64s(&wh), f64s(&dyh));

    // Forward: eager, captured, replayed, replayed — bit-identical, and right.
    let mut y = poisoned::<T>(&ctx, yl);
    let want = conv2d(&s, &xf, &wf).unwrap();
    let runs = repeat(&ctx, &what("fwd"), &mut y, &want, 4, |y| {
        conv.forward_with(graph, &x, &w, y)
    });
    assert_all_equal(&what("fwd"), &runs);
    let (captured, replayed) = counts.get();
    assert!(
        captured >= 1 && replayed >= 2,
        "{}: captured {captured}, replayed {replayed}",
        what("fwd")
    );

    // A replay reads what was written into its buffers since the capture.
    let x2 = rng.vec::<T>(xl, -1.0, 1.0);
    ctx.stream().memcpy_htod(&x2, &mut x).unwrap();
    let want2 = conv2d(&s, &f64s(&x2), &wf).unwrap();
    repeat(&ctx, &what("fwd, fresh x"), &mut y, &want2, 1, |y| {
        conv.forward_with(graph, &x, &w, y)
    });
    assert!(
        counts.get().1 > replayed,
        "{}: the fresh input was not replayed",
        what("fwd")
    );
    ctx.stream().memcpy_htod(&xh, &mut x).unwrap();

    // Another output buffer is another key: executed, then captured, and right every time.
    let mut y_other = poisoned::<T>(&ctx, yl);
    let runs = repeat(&ctx, &what("fwd, other y"), &mut y_other, &want, 3, |y| {
        conv.forward_with(graph, &x, &w, y)
    });
    assert_all_equal(&what("fwd, other y"), &runs);

    // Both gradients.
    let mut dx = poisoned::<T>(&ctx, xl);
    let want = backward_data(&s, &dyf, &wf);
    let runs = repeat(&ctx, &what("dgrad"), &mut dx, &want, 3, |dx| {
        conv.backward_data_with(graph, &dy, &w, dx)
    });
    assert_all_equal(&what("dgrad"), &runs);
    let mut dw = poisoned::<T>(&ctx, wl);
    let want = backward_filter(&s, &xf, &dyf);
    let runs = repeat(&ctx, &what("wgrad"), &mut dw, &want, 3, |dw| {
        conv.backward_filter_with(graph, &x, &dy, dw, false)
    });
    assert_all_equal(&what("wgrad"), &runs);

    // Accumulating: each replay adds once more (dw = dw0 + 4 · dW, dw0 = one dW).
    conv.backward_filter_with(graph, &x, &dy, &mut dw, false)
        .unwrap();
    for _ in 0..4 {
        conv.backward_filter_with(graph, &x, &dy, &mut dw, true)
            .unwrap();
    }
    let got = f64s(&download(&ctx, &dw));
    let five: Vec<f64> = want.iter().map(|v| 5.0 * v).collect();
    compare(
        &what("wgrad accumulated 4 times"),
        &got,
        &five,
        T::DTYPE.tolerance(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_convolutions_replay_bit_identical_and_read_fresh_inputs() {
    conv_case::<f16>(ConvPath::CudnnGraph, TensorFormat::Nhwc, "replay_conv_f16");
    conv_case::<f32>(ConvPath::CudnnGraph, TensorFormat::Nchw, "replay_conv_f32");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn legacy_convolutions_replay_bit_identical_and_read_fresh_inputs() {
    conv_case::<f16>(
        ConvPath::Cudnn,
        TensorFormat::Nhwc,
        "replay_legacy_conv_f16",
    );
    conv_case::<f32>(
        ConvPath::Cudnn,
        TensorFormat::Nchw,
        "replay_legacy_conv_f32",
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn replay_off_captures_nothing_and_gives_the_same_bits() {
    let (counts, _guard) = count_events();
    let ctx = graph_ctx(false);
    let mut rng = Rng::fresh("replay_off");
    let s = ConvShape::square(2, 16, 8, 24, 3, TensorFormat::Nhwc);
    let conv = Conv2d::<f16>::new(&ctx, &s).unwrap();
    let x = upload(&ctx, &rng.vec::<f16>(s.x_len().unwrap(), -1.0, 1.0));
    let w = upload(&ctx, &rng.vec::<f16>(s.w_len().unwrap(), -1.0, 1.0));
    let want = conv2d(&s, &f64s(&download(&ctx, &x)), &f64s(&download(&ctx, &w))).unwrap();
    let mut y = poisoned::<f16>(&ctx, s.y_len().unwrap());
    let graph = Route::path(ConvPath::CudnnGraph);
    let runs = repeat(&ctx, "replay off", &mut y, &want, 4, |y| {
        conv.forward_with(graph, &x, &w, y)
    });
    assert_all_equal("replay off", &runs);
    assert_eq!(
        counts.get(),
        (0, 0),
        "replay off still captured or replayed"
    );
}

/// One BatchNorm's buffers on one Context.
struct BnBufs<T: Element> {
    bn: BatchNorm<T>,
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

struct BnHost<T> {
    x: Vec<T>,
    z: Vec<T>,
    dy: Vec<T>,
    gamma: Vec<f32>,
    beta: Vec<f32>,
    rm: Vec<f32>,
    rv: Vec<f32>,
}

impl<T: Element> BnBufs<T> {
    fn new(ctx: &Context, shape: &[usize], fuse: Fuse, h: &BnHost<T>) -> Self {
        let n = h.x.len();
        let c = h.gamma.len();
        BnBufs {
            bn: BatchNorm::<T>::new(ctx, shape, shape.len() - 1, fuse).unwrap(),
            x: upload(ctx, &h.x),
            z: upload(ctx, &h.z),
            dy: upload(ctx, &h.dy),
            gamma: upload(ctx, &h.gamma),
            beta: upload(ctx, &h.beta),
            rm: upload(ctx, &h.rm),
            rv: upload(ctx, &h.rv),
            y: poisoned(ctx, n),
            dx: poisoned(ctx, n),
            dz: poisoned(ctx, n),
            dg: poisoned(ctx, c),
            db: poisoned(ctx, c),
        }
    }

    /// Poisons the outputs, runs a training forward and backward; every output's bits, and
    /// whether the forward ran the graph.
    fn step(&mut self, ctx: &Context, add: bool, momentum: f64) -> (Vec<Vec<u64>>, bool) {
        for b in [&mut self.y, &mut self.dx, &mut self.dz] {
            nnfuse::internals::util::fill(ctx, b, T::from_f64(f64::NAN)).unwrap();
        }
        for b in [&mut self.dg, &mut self.db] {
            nnfuse::internals::util::fill(ctx, b, f32::NAN).unwrap();
        }
        let saved = self
            .bn
            .forward_train(TrainArgs {
                x: self.x.as_view(),
                addend: add.then(|| self.z.as_view()),
                gamma: self.gamma.as_view(),
                beta: self.beta.as_view(),
                running_mean: self.rm.as_view_mut(),
                running_var: self.rv.as_view_mut(),
                y: self.y.as_view_mut(),
                momentum,
                eps: common::bn::EPS,
            })
            .unwrap();
        self.bn
            .backward(BackwardArgs {
                x: self.x.as_view(),
                y: self.y.as_view(),
                dy: self.dy.as_view(),
                gamma: self.gamma.as_view(),
                beta: self.beta.as_view(),
                saved: &saved,
                dx: self.dx.as_view_mut(),
                d_addend: add.then(|| self.dz.as_view_mut()),
                dgamma: self.dg.as_view_mut(),
                dbeta: self.db.as_view_mut(),
            })
            .unwrap();
        let mut out = vec![bits(ctx, &self.y), bits(ctx, &self.dx)];
        if add {
            out.push(bits(ctx, &self.dz));
        }
        for b in [&self.rm, &self.rv, &self.dg, &self.db] {
            out.push(bits(ctx, b));
        }
        (out, saved.ran_graph())
    }
}

fn bn_case<T: Element>(api: CudnnApi, fuse: Fuse, tag: &str) {
    let (counts, _guard) = count_events();
    let config = |replay| {
        Config::default()
            .with_bn_impl(BnImpl::Cudnn)
            .with_cudnn_api(api)
            .with_deterministic(true)
            .with_cudnn_replay(replay)
    };
    let (on, off) = (gpu_with(config(true)), gpu_with(config(false)));
    let shape = [4usize, 6, 6, 32];
    let (n, c) = (shape.iter().product::<usize>(), shape[3]);
    let mut rng = Rng::fresh(tag);
    let host = BnHost {
        x: rng.vec::<T>(n, -2.0, 3.0),
        z: rng.vec::<T>(n, -1.0, 1.0),
        dy: rng.vec::<T>(n, -1.0, 1.0),
        gamma: rng.vec(c, 0.5, 1.5),
        beta: rng.vec(c, -0.5, 0.5),
        rm: rng.vec(c, -0.1, 0.1),
        rv: rng.vec(c, 0.5, 1.5),
    };
    let add = fuse == Fuse::AddRelu;
    let (mut a, mut b) = (
        BnBufs::new(&on, &shape, fuse, &host),
        BnBufs::new(&off, &shape, fuse, &host),
    );
    let what = format!("BatchNorm {api} {:?} {} {}", fuse, T::DTYPE, tag);
    // Steps 0-3 repeat every buffer and scalar (eager, captured, replayed, replayed; fresh x
    // before step 3); step 4 changes the momentum (a new key: executed, never the stale graph).
    let mut ran_graph = false;
    for step in 0..5 {
        if step == 3 {
            let x2 = rng.vec::<T>(n, -2.0, 3.0);
            on.stream().memcpy_htod(&x2, &mut a.x).unwrap();
            off.stream().memcpy_htod(&x2, &mut b.x).unwrap();
        }
        let momentum = if step == 4 { 0.3 } else { 0.1 };
        let ((got, graph), (want, _)) = (a.step(&on, add, momentum), b.step(&off, add, momentum));
        ran_graph |= graph;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let diff = g.iter().zip(w).filter(|(p, q)| p != q).count();
            assert_eq!(
                diff, 0,
                "{what}: step {step}, output {i}: {diff} elements differ from replay off"
            );
        }
    }
    assert_eq!(
        ran_graph,
        api == CudnnApi::Graph,
        "{what}: whether the graph route ran, against the configuration"
    );
    let (captured, replayed) = counts.get();
    assert!(
        captured >= 2 && replayed >= 2,
        "{what}: captured {captured}, replayed {replayed}"
    );

    // The last step against f64 (x as written before step 3; the running statistics after 4
    // updates are not re-derived here, y and the gradients are).
    let sh = BnShape::new(&shape, 3).unwrap();
    let x = f64s(&download(&on, &a.x));
    let (g, bt) = (f64s(&host.gamma), f64s(&host.beta));
    let (rm, rv) = (vec![0.0; c], vec![1.0; c]);
    let z = f64s(&host.z);
    let act = common::bn::activation(fuse, &z);
    let f = rb::train_forward(&sh, &x, &g, &bt, &rm, &rv, 0.3, common::bn::EPS, act).unwrap();
    let tol = T::DTYPE.tolerance();
    assert_close(
        &format!("{what}: y"),
        &f64s(&download(&on, &a.y)),
        &f.y,
        tol,
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_batchnorm_replays_bit_identical_to_executing_every_call() {
    bn_case::<f16>(CudnnApi::Graph, Fuse::None, "replay_bn_f16");
    bn_case::<f16>(CudnnApi::Graph, Fuse::AddRelu, "replay_bn_f16_add_relu");
    bn_case::<f32>(CudnnApi::Graph, Fuse::None, "replay_bn_f32");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn legacy_batchnorm_replays_bit_identical_to_executing_every_call() {
    bn_case::<f16>(CudnnApi::Legacy, Fuse::None, "replay_legacy_bn_f16");
    bn_case::<f16>(CudnnApi::Legacy, Fuse::Relu, "replay_legacy_bn_f16_relu");
    bn_case::<f16>(
        CudnnApi::Legacy,
        Fuse::AddRelu,
        "replay_legacy_bn_f16_add_relu",
    );
    bn_case::<f32>(CudnnApi::Legacy, Fuse::None, "replay_legacy_bn_f32");
}
