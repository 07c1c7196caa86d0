//! The data gradient's accumulate mode on the GPU (`Conv2d::backward_data_into`,
//! `backward_data_with_into`): `dx += bwd_data(dy, w)` on every route forced, for f16 and bf16
//! (NHWC) and f32 (NCHW and NHWC), starting from fresh nonzero dx values and compared with the
//! f64 reference `dx0 + dgrad` (f32 1e-5, f16/bf16 1e-2 relative L2); a route that cannot add
//! (Winograd) refuses with the plan's reason and leaves dx untouched; `auto` adds, also where
//! the decided route is one that cannot (the substitute is named in the choice's notes).

mod common;
mod conv_ref;

use half::{bf16, f16};
use nnfuse::config::{Config, ConvAlgoPolicy};
use nnfuse::conv::{Conv2d, ConvPath, ConvShape, Direction, Route, WinogradEngine};
use nnfuse::internals::conv::usable;
use nnfuse::{Context, DType, Element, Error, TensorFormat};

use common::{conv_tolerance, download, f64s, gpu, gpu_with, square_conv, upload, Rng};
use conv_ref::{backward_data, compare, describe};

/// The tolerance of the accumulated result (no Winograd route adds).
fn tol(dt: DType) -> f64 {
    match dt {
        DType::F32 => 1e-5,
        DType::F16 | DType::BF16 => 1e-2,
    }
}

/// The problems: 3x3 stride 1 (Winograd's data gradient eligible in NHWC), 3x3 stride 2 with an
/// odd size, and a pointwise 1x1 (im2col's GEMM writes dx: beta adds).
fn shapes(format: TensorFormat) -> Vec<ConvShape> {
    vec![
        square_conv(3, 32, 14, 48, 3, format),
        ConvShape {
            n: 2,
            c_in: 24,
            h: 15,
            w: 13,
            c_out: 16,
            kh: 3,
            kw: 3,
            stride: (2, 2),
            pad: (1, 1),
            dilation: (1, 1),
            format,
        },
        square_conv(2, 64, 9, 32, 1, format),
    ]
}

/// Every route of the data gradient the plan lets a caller force: each usable cuDNN algorithm,
/// the graph API, im2col + GEMM, each Winograd engine.
fn routes<T: Element>(conv: &Conv2d<T>, ctx: &Context) -> Vec<Route> {
    let d = Direction::BackwardData;
    let plan = conv.plan_for(d);
    let mut out = Vec::new();
    for p in ConvPath::ALL {
        if !plan.eligible(p) {
            continue;
        }
        match p {
            ConvPath::Cudnn => {
                out.push(Route::path(p));
                let list = conv.cudnn_heuristics(d).expect("cuDNN heuristics");
                let (ok, _, _) =
                    usable(&list, T::DTYPE, ctx.config().conv_workspace_bytes(), false);
                out.extend(ok.iter().map(|q| Route::cudnn(q.algo)));
            }
            ConvPath::WinogradF2x3 | ConvPath::WinogradF4x3 => {
                let tile = p.winograd_tile().expect("a Winograd path");
                out.extend(
                    WinogradEngine::ALL
                        .iter()
                        .map(|&e| Route::winograd(tile, e)),
                );
            }
            _ => out.push(Route::path(p)),
        }
    }
    out
}

struct Data<T> {
    dy: Vec<T>,
    w: Vec<T>,
    dx0: Vec<T>,
    /// `dx0 + bwd_data(dy, w)` in f64, from the values as the GPU sees them.
    want: Vec<f64>,
}

fn data<T: Element>(s: &ConvShape, rng: &mut Rng) -> Data<T> {
    let dy: Vec<T> = rng.vec(s.y_len().unwrap(), -1.0, 1.0);
    let w: Vec<T> = rng.vec(s.w_len().unwrap(), -1.0, 1.0);
    // Fresh nonzero values: a route that overwrote dx would be caught.
    let dx0: Vec<T> = rng.vec(s.x_len().unwrap(), 0.5, 1.5);
    let g = backward_data(s, &f64s(&dy), &f64s(&w));
    let want = f64s(&dx0).iter().zip(&g).map(|(a, b)| a + b).collect();
    Data { dy, w, dx0, want }
}

fn forced_case<T: Element>(
    ctx: &Context,
    s: &ConvShape,
    rng: &mut Rng,
    failures: &mut Vec<String>,
) {
    let conv = Conv2d::<T>::new(ctx, s).expect("plan");
    let d = data::<T>(s, rng);
    let (dyd, wd) = (upload(ctx, &d.dy), upload(ctx, &d.w));
    let tag = format!("{} {}", describe(s), T::DTYPE);
    let plan = conv.plan_for(Direction::BackwardData);
    for route in routes(&conv, ctx) {
        let what = format!("{tag} dx += via {route}");
        let mut dx = upload(ctx, &d.dx0);
        let r = conv.backward_data_with_into(route, &dyd, &wd, &mut dx, true);
        match (plan.accumulate_refusal(route.path), r) {
            (None, Ok(())) => {
                let got = f64s(&download(ctx, &dx));
                if let Err(m) = compare(&what, &got, &d.want, tol(T::DTYPE)) {
                    failures.push(m);
                }
            }
            (None, Err(e)) => failures.push(format!("{what}: the forced route failed: {e}")),
            (Some(why), Err(Error::NotSupported(m))) if m.contains(why) => {
                let got = download(ctx, &dx);
                let same = got
                    .iter()
                    .zip(&d.dx0)
                    .all(|(a, b)| a.to_f64().to_bits() == b.to_f64().to_bits());
                if !same {
                    failures.push(format!("{what}: refused, but dx changed"));
                }
            }
            (Some(why), r) => failures.push(format!(
                "{what}: the plan refuses it ({why}), the call returned {r:?}"
            )),
        }
    }
}

/// Every route forced, accumulating onto nonzero dx, against `dx0 + dgrad` in f64; a route that
/// cannot add refuses with the plan's reason and leaves dx as it was. The default workspace
/// and a 1 MiB one (im2col's data gradient chunked: col2im adds chunk by chunk).
#[test]
#[ignore = "needs a CUDA GPU"]
fn every_route_adds_the_data_gradient_to_dx() {
    let mut rng = Rng::fresh("every_route_adds_the_data_gradient_to_dx");
    let mut failures = Vec::new();
    for ctx in [
        gpu(),
        gpu_with(Config {
            conv_workspace_mb: 1,
            ..Config::default()
        }),
    ] {
        for s in shapes(TensorFormat::Nhwc) {
            forced_case::<f16>(&ctx, &s, &mut rng, &mut failures);
            forced_case::<bf16>(&ctx, &s, &mut rng, &mut failures);
            forced_case::<f32>(&ctx, &s, &mut rng, &mut failures);
        }
        for s in shapes(TensorFormat::Nchw) {
            forced_case::<f32>(&ctx, &s, &mut rng, &mut failures);
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn auto_case<T: Element>(ctx: &Context, s: &ConvShape, rng: &mut Rng) {
    let conv = Conv2d::<T>::new(ctx, s).expect("plan");
    let d = data::<T>(s, rng);
    let (dyd, wd) = (upload(ctx, &d.dy), upload(ctx, &d.w));
    // The first call (the decision, measured on its own buffers) accumulates too.
    let mut dx = upload(ctx, &d.dx0);
    conv.backward_data_into(&dyd, &wd, &mut dx, true)
        .expect("auto accumulate");
    let c = conv.choice(Direction::BackwardData).expect("decided");
    let plan = conv.plan_for(Direction::BackwardData);
    let what = format!("{} {} dx += auto -> {c}", describe(s), T::DTYPE);
    compare(&what, &f64s(&download(ctx, &dx)), &d.want, tol(T::DTYPE))
        .unwrap_or_else(|m| panic!("{m}"));
    if plan.accumulate_refusal(c.route.path).is_some() {
        assert!(
            c.notes.iter().any(|n| n.contains("accumulating calls run")),
            "{what}: the substitute is not named: {:?}",
            c.notes
        );
    }
    // A second accumulating call adds the gradient again; an overwriting one writes it.
    conv.backward_data_into(&dyd, &wd, &mut dx, true)
        .expect("again");
    let g = backward_data(s, &f64s(&d.dy), &f64s(&d.w));
    let twice: Vec<f64> = d.want.iter().zip(&g).map(|(a, b)| a + b).collect();
    compare(
        &format!("{what} twice"),
        &f64s(&download(ctx, &dx)),
        &twice,
        tol(T::DTYPE),
    )
    .unwrap_or_else(|m| panic!("{m}"));
    conv.backward_data_into(&dyd, &wd, &mut dx, false)
        .expect("overwrite");
    compare(
        &format!("{what} overwrite"),
        &f64s(&download(ctx, &dx)),
        &g,
        // The decided route overwrites: held to its own bound (Winograd's is documented per
        // tile and type, bf16 F(4x4) up to ~3e-2).
        conv_tolerance(c.route.path, T::DTYPE),
    )
    .unwrap_or_else(|m| panic!("{m}"));
    eprintln!("{what}");
}

/// `auto` accumulates correctly, on its first call and after; and where Winograd is forced by
/// the policy (the decided route cannot add), accumulating calls run a substitute that the
/// choice's notes name, with the same result.
#[test]
#[ignore = "needs a CUDA GPU"]
fn auto_adds_the_data_gradient_to_dx() {
    let mut rng = Rng::fresh("auto_adds_the_data_gradient_to_dx");
    for policy in [ConvAlgoPolicy::Auto, ConvAlgoPolicy::Winograd] {
        let ctx = gpu_with(Config {
            conv_algo: policy,
            ..Config::default()
        });
        for s in shapes(TensorFormat::Nhwc) {
            auto_case::<f16>(&ctx, &s, &mut rng);
            auto_case::<bf16>(&ctx, &s, &mut rng);
            auto_case::<f32>(&ctx, &s, &mut rng);
        }
        for s in shapes(TensorFormat::Nchw) {
            auto_case::<f32>(&ctx, &s, &mut rng);
        }
    }
}
