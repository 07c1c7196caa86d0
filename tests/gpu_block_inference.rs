//! The folded conv+BN inference unit on the GPU: every route forced, for every data type and
//! layout, against the f64 reference of conv + BatchNorm + add + ReLU; the first call's
//! decision; routes the plan refuses; misaligned operands; bad arguments. Outputs are poisoned
//! (NaN) before every run and inputs fresh and random. Ignored without a GPU.

mod common;

use common::*;
use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use nnfuse::block::{reference_forward, BlockRoute, BnHost, ConvBnInference, ConvBnParams};
use nnfuse::conv::ConvShape;
use nnfuse::internals::block::tolerance;
use nnfuse::{Context, DType, Element, Error, TensorFormat};

/// One test at a time: a CUDA graph capture (`decided_units_capture`) makes another thread's
/// synchronizing call fail (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, seen on the H100), and the
/// first-call timings should not share the GPU.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// One unit's host data (rounded to `T` where the GPU sees `T`) and its device copies.
struct Unit<T: Element> {
    shape: ConvShape,
    x: Vec<f64>,
    w: Vec<f64>,
    z: Vec<f64>,
    gamma: Vec<f64>,
    beta: Vec<f64>,
    mean: Vec<f64>,
    var: Vec<f64>,
    dx: CudaSlice<T>,
    dz: CudaSlice<T>,
    unit: ConvBnInference<T>,
}

const EPS: f64 = 1e-5;

impl<T: Element> Unit<T> {
    fn new(ctx: &Context, shape: ConvShape, rng: &mut Rng) -> Unit<T> {
        let k = (shape.c_in * shape.kh * shape.kw) as f64;
        let xt: Vec<T> = rng.vec(shape.x_len().unwrap(), -1.0, 1.0);
        let wt: Vec<T> = rng.vec(shape.w_len().unwrap(), -1.0 / k.sqrt(), 1.0 / k.sqrt());
        let zt: Vec<T> = rng.vec(shape.y_len().unwrap(), -1.0, 1.0);
        let c = shape.c_out;
        let gamma: Vec<f32> = rng.vec(c, 0.5, 1.5);
        let beta: Vec<f32> = rng.vec(c, -0.5, 0.5);
        let mean: Vec<f32> = rng.vec(c, -0.2, 0.2);
        let var: Vec<f32> = rng.vec(c, 0.3, 2.0);
        let (dw, dg, db, dm, dv) = (
            upload(ctx, &wt),
            upload(ctx, &gamma),
            upload(ctx, &beta),
            upload(ctx, &mean),
            upload(ctx, &var),
        );
        let unit = ConvBnInference::<T>::new(
            ctx,
            &shape,
            ConvBnParams {
                w: dw.as_view(),
                gamma: dg.as_view(),
                beta: db.as_view(),
                running_mean: dm.as_view(),
                running_var: dv.as_view(),
                eps: EPS,
            },
        )
        .unwrap();
        Unit {
            shape,
            x: f64s(&xt),
            w: f64s(&wt),
            z: f64s(&zt),
            gamma: f64s(&gamma),
            beta: f64s(&beta),
            mean: f64s(&mean),
            var: f64s(&var),
            dx: upload(ctx, &xt),
            dz: upload(ctx, &zt),
            unit,
        }
    }

    fn want(&self, shortcut: bool, relu: bool) -> Vec<f64> {
        let bn = BnHost {
            gamma: &self.gamma,
            beta: &self.beta,
            running_mean: &self.mean,
            running_var: &self.var,
            eps: EPS,
        };
        let z = shortcut.then_some(&self.z[..]);
        reference_forward(&self.shape, &self.x, &self.w, &bn, z, relu).unwrap()
    }

    /// Runs `route` (None: the decided one) into a poisoned output.
    fn run(
        &self,
        ctx: &Context,
        route: Option<BlockRoute>,
        shortcut: bool,
        relu: bool,
    ) -> nnfuse::Result<Vec<f64>> {
        let mut y = poisoned::<T>(ctx, self.shape.y_len().unwrap());
        let z = self.dz.as_view();
        let z = shortcut.then_some(&z);
        let x = self.dx.as_view();
        match route {
            Some(r) => self
                .unit
                .forward_with(r, &x, z, relu, &mut y.as_view_mut())?,
            None => self.unit.forward(&x, z, relu, &mut y.as_view_mut())?,
        }
        Ok(f64s(&download(ctx, &y)))
    }
}

fn shapes(format: TensorFormat) -> Vec<ConvShape> {
    let s = |c_in, c_out, kh, stride, pad| ConvShape {
        n: 2,
        c_in,
        h: 9,
        w: 7,
        c_out,
        kh,
        kw: kh,
        stride: (stride, stride),
        pad: (pad, pad),
        dilation: (1, 1),
        format,
    };
    vec![
        s(32, 16, 1, 1, 0), // pointwise: the GEMM on the input itself
        s(16, 32, 3, 1, 1), // 3x3 through im2col
        s(16, 24, 1, 2, 0), // strided 1x1
        s(3, 6, 3, 2, 1),   // odd channels, unaligned leading dimensions
    ]
}

/// Every eligible route forced, every (shortcut, ReLU) combination, against f64. A cuDNN
/// status from `cudnn_fused` (cuDNN refusing a configuration of its fused call), and cuBLASLt
/// finding no algorithm on the odd-channel shape, are printed and tolerated: the first call's
/// check drops such a route (see `first_call_decides`).
fn every_route<T: Element>(format: TensorFormat) {
    let ctx = gpu();
    let mut rng = Rng::fresh("block_inference");
    let tol = tolerance(T::DTYPE);
    for shape in shapes(format) {
        let u = Unit::<T>::new(&ctx, shape, &mut rng);
        for r in BlockRoute::ALL {
            if !u.unit.plan().eligible(r) {
                continue;
            }
            for (shortcut, relu) in [(true, true), (false, true), (false, false), (true, false)] {
                let what = format!(
                    "{} {format} {shape:?} {r} shortcut={shortcut} relu={relu}",
                    T::DTYPE
                );
                match u.run(&ctx, Some(r), shortcut, relu) {
                    Ok(got) => assert_close(&what, &got, &u.want(shortcut, relu), tol),
                    // cuBLASLt may have no algorithm for leading dimensions of 3 or 27 halves.
                    Err(e @ Error::NotSupported(_))
                        if r == BlockRoute::GemmEpilogue && shape.c_in == 3 =>
                    {
                        eprintln!("{what}: cuBLASLt refused: {e}")
                    }
                    Err(e @ Error::Cudnn { .. }) if r == BlockRoute::CudnnFused => {
                        eprintln!("{what}: cuDNN refused: {e}")
                    }
                    Err(e) => panic!("{what}: {e}"),
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_route_f32_nchw() {
    let _serial = serial();
    every_route::<f32>(TensorFormat::Nchw);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_route_f32_nhwc() {
    let _serial = serial();
    every_route::<f32>(TensorFormat::Nhwc);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_route_f16_nhwc() {
    let _serial = serial();
    every_route::<f16>(TensorFormat::Nhwc);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_route_bf16_nhwc() {
    let _serial = serial();
    every_route::<bf16>(TensorFormat::Nhwc);
}

/// The first call decides per (shortcut, ReLU): its output and later calls' match f64, the
/// choice names a route the plan allows and says why each fused candidate won or was dropped.
fn first_call_decides<T: Element>(format: TensorFormat) {
    let ctx = gpu();
    let mut rng = Rng::fresh("block_inference_auto");
    let tol = tolerance(T::DTYPE);
    for shape in shapes(format) {
        let u = Unit::<T>::new(&ctx, shape, &mut rng);
        for (shortcut, relu) in [(true, true), (false, true)] {
            let what = format!(
                "{} {format} {shape:?} auto shortcut={shortcut} relu={relu}",
                T::DTYPE
            );
            assert!(u.unit.choice(shortcut, relu).is_none());
            for call in 0..3 {
                let got = u.run(&ctx, None, shortcut, relu).unwrap();
                assert_close(
                    &format!("{what} call {call}"),
                    &got,
                    &u.want(shortcut, relu),
                    tol,
                );
            }
            let c = u.unit.choice(shortcut, relu).expect("decided");
            assert!(u.unit.plan().eligible(c.route), "{what}: {c:?}");
            assert!(
                c.notes.len() >= u.unit.plan().fused_candidates().len(),
                "{what}: {c:?}"
            );
            eprintln!("{what}: {} {:?} {:?}", c.route, c.times_us, c.notes);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn first_call_decides_f32_nchw() {
    let _serial = serial();
    first_call_decides::<f32>(TensorFormat::Nchw);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn first_call_decides_f16_nhwc() {
    let _serial = serial();
    first_call_decides::<f16>(TensorFormat::Nhwc);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn first_call_decides_bf16_nhwc() {
    let _serial = serial();
    first_call_decides::<bf16>(TensorFormat::Nhwc);
}

/// A route the plan refuses is an error carrying the plan's reason (NCHW has no GEMM route),
/// and the decision falls back to what the plan allows.
#[test]
#[ignore = "needs a CUDA GPU"]
fn refused_routes_say_why_and_fall_back() {
    let _serial = serial();
    let ctx = gpu();
    let mut rng = Rng::fresh("block_inference_refused");
    let shape = shapes(TensorFormat::Nchw)[0];
    let u = Unit::<f32>::new(&ctx, shape, &mut rng);
    let e = u
        .run(&ctx, Some(BlockRoute::GemmEpilogue), true, true)
        .unwrap_err();
    assert!(matches!(e, Error::NotSupported(_)), "{e}");
    assert!(e.to_string().contains("NCHW"), "{e}");
    let got = u.run(&ctx, None, true, true).unwrap();
    assert_close(
        "nchw auto",
        &got,
        &u.want(true, true),
        tolerance(DType::F32),
    );
    assert_ne!(
        u.unit.choice(true, true).unwrap().route,
        BlockRoute::GemmEpilogue
    );
}

/// Operands off the GEMM algorithm's 16-byte alignment: the forced GEMM route refuses with a
/// reason, the decided route runs this call unfused, and the result is right either way.
#[test]
#[ignore = "needs a CUDA GPU"]
fn misaligned_operands_run_unfused() {
    let _serial = serial();
    let ctx = gpu();
    let mut rng = Rng::fresh("block_inference_misaligned");
    let shape = shapes(TensorFormat::Nhwc)[0];
    let u = Unit::<f16>::new(&ctx, shape, &mut rng);
    let n = shape.y_len().unwrap();
    let want = u.want(true, true);
    // Decide first on aligned operands.
    let _ = u.run(&ctx, None, true, true).unwrap();
    let mut y = poisoned::<f16>(&ctx, n + 1);
    let x = u.dx.as_view();
    let z = u.dz.as_view();
    {
        let mut yv = y.slice_mut(1..);
        let e = u
            .unit
            .forward_with(BlockRoute::GemmEpilogue, &x, Some(&z), true, &mut yv)
            .unwrap_err();
        assert!(e.to_string().contains("aligned"), "{e}");
        u.unit.forward(&x, Some(&z), true, &mut yv).unwrap();
    }
    let got = f64s(&download(&ctx, &y)[1..]);
    assert_close("misaligned y", &got, &want, tolerance(DType::F16));
}

/// A first call whose unfused output has a non-finite element (an infinity in x) cannot judge
/// a fused route against it: it keeps `unfused` and says why.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_non_finite_first_call_keeps_unfused_and_says_why() {
    let _serial = serial();
    let ctx = gpu();
    let mut rng = Rng::fresh("block_inference_non_finite");
    let shape = shapes(TensorFormat::Nhwc)[0];
    let mut u = Unit::<f16>::new(&ctx, shape, &mut rng);
    assert!(!u.unit.plan().fused_candidates().is_empty());
    let mut x = download(&ctx, &u.dx);
    x[3] = f16::INFINITY;
    u.dx = upload(&ctx, &x);
    let got = u.run(&ctx, None, true, true).unwrap();
    assert!(
        got.iter().any(|v| !v.is_finite()),
        "the infinity reached no output"
    );
    let c = u.unit.choice(true, true).expect("decided");
    assert_eq!(c.route, BlockRoute::Unfused, "{c:?}");
    assert!(c.notes.iter().any(|n| n.contains("non-finite")), "{c:?}");
}

/// Bad arguments never reach the GPU and name themselves.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_arguments_are_named() {
    let _serial = serial();
    let ctx = gpu();
    let mut rng = Rng::fresh("block_inference_bad");
    let shape = shapes(TensorFormat::Nhwc)[1];
    let u = Unit::<f32>::new(&ctx, shape, &mut rng);
    let n = shape.y_len().unwrap();
    let mut y = poisoned::<f32>(&ctx, n);
    let x = u.dx.as_view();
    let short = u.dx.slice(1..);
    let e = u
        .unit
        .forward(&short, None, true, &mut y.as_view_mut())
        .unwrap_err();
    assert_eq!(e.argument(), Some("x"), "{e}");
    let z = u.dz.slice(1..);
    let e = u
        .unit
        .forward(&x, Some(&z), true, &mut y.as_view_mut())
        .unwrap_err();
    assert_eq!(e.argument(), Some("shortcut"), "{e}");
    let e = u
        .unit
        .forward(&x, None, true, &mut y.slice_mut(1..))
        .unwrap_err();
    assert_eq!(e.argument(), Some("y"), "{e}");
    let w = upload(&ctx, &vec![0.1f32; shape.w_len().unwrap()]);
    let ones = upload(&ctx, &vec![1.0f32; shape.c_out]);
    let fewer = upload(&ctx, &vec![1.0f32; shape.c_out - 1]);
    let params = |gamma: &CudaSlice<f32>, eps: f64| {
        ConvBnInference::<f32>::new(
            &ctx,
            &shape,
            ConvBnParams {
                w: w.as_view(),
                gamma: gamma.as_view(),
                beta: ones.as_view(),
                running_mean: ones.as_view(),
                running_var: ones.as_view(),
                eps,
            },
        )
    };
    assert_eq!(params(&fewer, EPS).unwrap_err().argument(), Some("gamma"));
    assert_eq!(params(&ones, 0.0).unwrap_err().argument(), Some("eps"));
    let negative = upload(&ctx, &vec![-1.0f32; shape.c_out]);
    let e = ConvBnInference::<f32>::new(
        &ctx,
        &shape,
        ConvBnParams {
            w: w.as_view(),
            gamma: ones.as_view(),
            beta: ones.as_view(),
            running_mean: ones.as_view(),
            running_var: negative.as_view(),
            eps: EPS,
        },
    )
    .unwrap_err();
    assert_eq!(e.argument(), Some("running_var"), "{e}");
}

/// Capture-safe once decided: after the first call, a unit's forward (whatever route it chose)
/// captures into a CUDA graph whose replay writes the f64-close result into a poisoned output;
/// an undecided combination refuses under capture with a typed error.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decided_units_capture() {
    let _serial = serial();
    let ctx = gpu();
    // SAFETY: one stream; nothing allocated on this Context yet (as tests/gpu_capture.rs).
    unsafe { ctx.cuda().disable_event_tracking() };
    let mut rng = Rng::fresh("block_inference_capture");
    for shape in shapes(TensorFormat::Nhwc).into_iter().take(2) {
        let u = Unit::<f16>::new(&ctx, shape, &mut rng);
        let want = u.want(true, true);
        let _ = u.run(&ctx, None, true, true).unwrap();
        let mut y = poisoned::<f16>(&ctx, shape.y_len().unwrap());
        let (x, z) = (u.dx.as_view(), u.dz.as_view());
        let graph = ctx
            .capture(|_| u.unit.forward(&x, Some(&z), true, &mut y.as_view_mut()))
            .unwrap();
        graph.replay().unwrap();
        ctx.synchronize().unwrap();
        let route = u.unit.choice(true, true).unwrap().route;
        assert_close(
            &format!("{shape:?} captured {route}"),
            &f64s(&download(&ctx, &y)),
            &want,
            tolerance(DType::F16),
        );
        let e = ctx
            .capture(|_| u.unit.forward(&x, None, false, &mut y.as_view_mut()))
            .unwrap_err();
        assert!(matches!(e, Error::Capture { .. }), "{e}");
    }
}
