//! The data gradient's accumulate mode on the GPU (`Conv2d::backward_data_into`,
//! `backward_data_with_into`): `dx += bwd_data(dy, w)` on every route forced, for f16 and bf16
//! (NHWC) and f32 (NCHW and NHWC), starting from fresh nonzero dx values and compared with the
//! f64 reference `dx0 + dgrad` (f32 1e-5, f16/bf16 1e-2 relative L2); a route that cannot add
//! (Winograd) refuses with the plan's reason and leaves dx untouched; `auto` adds, also where
//! the overwriting decision is a route that cannot (accumulating calls have a decision of their
//! own, made among the routes that can add, measured adding; `Conv2d::choice_for`), for the
//! data and the filter gradient.

mod common;
mod conv_ref;

use half::{bf16, f16};
use nnfuse::config::{Config, ConvAlgoPolicy};
use nnfuse::conv::{Conv2d, ConvPath, ConvShape, Direction, Outcome, Route, WinogradEngine};
use nnfuse::internals::conv::usable;
use nnfuse::{Context, DType, Element, Error, TensorFormat};

use common::{conv_tolerance, download, f64s, gpu, gpu_with, poisoned, square_conv, upload, Rng};
use conv_ref::{backward_data, backward_filter, compare, describe};

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
                    usable(&list, T::DTYPE, ctx.config().cudnn_workspace_bytes(), false);
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
    // Overwriting calls have their own decision (made by this call; Winograd under its policy).
    let over = conv
        .choice_for(Direction::BackwardData, false)
        .expect("the overwriting calls' decision");
    compare(
        &format!("{what} overwrite -> {over}"),
        &f64s(&download(ctx, &dx)),
        &g,
        // The decided route overwrites: held to its own bound (Winograd's is documented per
        // tile and type, bf16 F(4x4) up to ~3e-2).
        conv_tolerance(over.route.path, T::DTYPE),
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

/// The candidates of `d`'s plan that can add (cuDNN's counted once: it may stand for several).
fn adding_candidates<T: Element>(conv: &Conv2d<T>, d: Direction) -> usize {
    let plan = conv.plan_for(d);
    plan.candidates
        .iter()
        .filter(|r| plan.accumulate_refusal(r.path).is_none())
        .count()
}

/// The accumulating decision of `d` on `conv` after its first (accumulating) call: a route that
/// can add; its measurement, when there was one, ran adding (`AutoReport::accumulate`, its
/// header says so), lists the candidates that cannot add as skipped with the plan's reason and
/// measured none of them; the overwriting decision is not made by it.
fn assert_accumulating_decision<T: Element>(conv: &Conv2d<T>, d: Direction, what: &str) {
    let plan = conv.plan_for(d);
    let c = conv.choice_for(d, true).expect("the accumulating decision");
    assert!(
        plan.accumulate_refusal(c.route.path).is_none(),
        "{what}: the accumulating decision {c} cannot add"
    );
    assert!(
        conv.choice_for(d, false).is_none(),
        "{what}: an accumulating call made the overwriting decision"
    );
    // choice() shows the only decision there is.
    assert_eq!(conv.choice(d).map(|c| c.route), Some(c.route), "{what}");
    let refused: Vec<&Route> = plan
        .candidates
        .iter()
        .filter(|r| plan.accumulate_refusal(r.path).is_some())
        .collect();
    if !refused.is_empty() {
        assert!(
            c.notes.iter().any(|n| n.contains("cannot add")),
            "{what}: the excluded candidates are not named: {:?}",
            c.notes
        );
    }
    let Some(r) = conv.report_for(d, true) else {
        assert!(
            adding_candidates(conv, d) < 2 && c.route.path != ConvPath::Cudnn,
            "{what}: several candidates can add, but nothing was measured ({c})"
        );
        return;
    };
    assert!(r.accumulate, "{what}: measured overwriting:\n{r}");
    assert!(format!("{r}").contains("accumulating"), "{what}:\n{r}");
    for line in &r.candidates {
        if let Some(why) = plan.accumulate_refusal(line.route.path) {
            let skipped = matches!(&line.outcome,
                Outcome::Skipped(m) if m.contains("cannot add") && m.contains(why));
            assert!(
                skipped && line.rel_l2.is_none(),
                "{what}: {} cannot add but was not skipped for it:\n{r}",
                line.route
            );
        }
    }
    assert!(
        r.candidates[r.winner].outcome == Outcome::Passed,
        "{what}: the winner did not pass:\n{r}"
    );
    assert_eq!(r.candidates[r.winner].route, c.route, "{what}:\n{r}");
}

/// The data gradient's problems of the decision tests: 3x3 stride 1 NHWC (Winograd among the
/// candidates: excluded from the accumulating measurement) and the demo's conv1 at a small
/// batch (1x1, 256 -> 64: the pointwise GEMM reads dx with beta = 1).
fn decision_shapes() -> Vec<ConvShape> {
    vec![
        square_conv(4, 64, 14, 64, 3, TensorFormat::Nhwc),
        square_conv(4, 64, 28, 256, 1, TensorFormat::Nhwc),
    ]
}

fn data_gradient_decisions<T: Element>(ctx: &Context, s: &ConvShape, rng: &mut Rng) {
    let dgrad = Direction::BackwardData;
    let conv = Conv2d::<T>::new(ctx, s).expect("plan");
    let d = data::<T>(s, rng);
    let (dyd, wd) = (upload(ctx, &d.dy), upload(ctx, &d.w));
    let what = format!("{} {} dgrad", describe(s), T::DTYPE);
    // The first call accumulates: it decides for accumulating calls.
    let mut dx = upload(ctx, &d.dx0);
    conv.backward_data_into(&dyd, &wd, &mut dx, true)
        .expect("first call, accumulating");
    assert_accumulating_decision(&conv, dgrad, &what);
    let acc = conv.choice_for(dgrad, true).expect("decided");
    compare(
        &format!("{what} dx += auto -> {acc}"),
        &f64s(&download(ctx, &dx)),
        &d.want,
        tol(T::DTYPE),
    )
    .unwrap_or_else(|m| panic!("{m}"));
    // An overwriting call decides separately, overwriting (NaN-poisoned dx).
    let g = backward_data(s, &f64s(&d.dy), &f64s(&d.w));
    let mut dx = poisoned::<T>(ctx, s.x_len().unwrap());
    conv.backward_data_into(&dyd, &wd, &mut dx, false)
        .expect("first overwriting call");
    let over = conv
        .choice_for(dgrad, false)
        .expect("the overwriting decision");
    if let Some(r) = conv.report_for(dgrad, false) {
        assert!(
            !r.accumulate,
            "{what}: the overwriting decision measured adding:\n{r}"
        );
    }
    compare(
        &format!("{what} dx = auto -> {over}"),
        &f64s(&download(ctx, &dx)),
        &g,
        conv_tolerance(over.route.path, T::DTYPE),
    )
    .unwrap_or_else(|m| panic!("{m}"));
    // Both decisions stay; choice() now shows the overwriting one; accumulating calls still run
    // their own route and add.
    assert_eq!(
        conv.choice_for(dgrad, true).map(|c| c.route),
        Some(acc.route)
    );
    assert_eq!(conv.choice(dgrad).map(|c| c.route), Some(over.route));
    let mut dx = upload(ctx, &d.dx0);
    conv.backward_data_into(&dyd, &wd, &mut dx, true)
        .expect("accumulating again");
    compare(
        &format!("{what} dx += again"),
        &f64s(&download(ctx, &dx)),
        &d.want,
        tol(T::DTYPE),
    )
    .unwrap_or_else(|m| panic!("{m}"));
    // Another Context of the same configuration, under a budget (an exhaustive one measures
    // afresh), takes the accumulating decision from the process cache (keyed by the mode), not
    // the overwriting one.
    if acc.origin == nnfuse::conv::ChoiceOrigin::Measured {
        let ctx2 = gpu_with(Config {
            conv_tune_budget_ms: Config::default().conv_tune_budget_ms,
            ..ctx.config().clone()
        });
        let conv2 = Conv2d::<T>::new(&ctx2, s).expect("plan");
        let (dy2, w2) = (upload(&ctx2, &d.dy), upload(&ctx2, &d.w));
        let mut dx2 = upload(&ctx2, &d.dx0);
        conv2
            .backward_data_into(&dy2, &w2, &mut dx2, true)
            .expect("another Context, accumulating");
        let c2 = conv2.choice_for(dgrad, true).expect("decided");
        assert_eq!(
            (c2.route, c2.origin),
            (acc.route, nnfuse::conv::ChoiceOrigin::Memory),
            "{what}"
        );
        compare(
            &format!("{what} dx += cached -> {c2}"),
            &f64s(&download(&ctx2, &dx2)),
            &d.want,
            tol(T::DTYPE),
        )
        .unwrap_or_else(|m| panic!("{m}"));
    }
    eprintln!("{what}: accumulating {acc}; overwriting {over}");
}

/// An auto `Conv2d` whose first data-gradient call accumulates decides for accumulating calls:
/// among the routes that can add (Winograd skipped for it in the report), each checked adding
/// into zeros and timed adding; the result is `dx0 + dgrad`. A later overwriting call decides on
/// its own (overwriting) and is correct; the accumulating decision stays, and another Context
/// reads it from the process cache under its own key. The budget is exhaustive so that every
/// candidate is measured (the budget is not part of the key).
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_accumulating_first_data_gradient_call_decides_for_accumulating_calls() {
    let mut rng =
        Rng::fresh("an_accumulating_first_data_gradient_call_decides_for_accumulating_calls");
    let ctx = gpu_with(Config {
        conv_tune_budget_ms: 0,
        ..Config::default()
    });
    for s in decision_shapes() {
        data_gradient_decisions::<f16>(&ctx, &s, &mut rng);
        data_gradient_decisions::<bf16>(&ctx, &s, &mut rng);
        data_gradient_decisions::<f32>(&ctx, &s, &mut rng);
    }
    let nchw = square_conv(4, 32, 14, 48, 3, TensorFormat::Nchw);
    data_gradient_decisions::<f32>(&ctx, &nchw, &mut rng);
}

fn filter_gradient_decisions<T: Element>(ctx: &Context, s: &ConvShape, rng: &mut Rng) {
    let wgrad = Direction::BackwardFilter;
    let conv = Conv2d::<T>::new(ctx, s).expect("plan");
    let x: Vec<T> = rng.vec(s.x_len().unwrap(), -1.0, 1.0);
    let dy: Vec<T> = rng.vec(s.y_len().unwrap(), -1.0, 1.0);
    let dw0: Vec<T> = rng.vec(s.w_len().unwrap(), 0.5, 1.5);
    let g = backward_filter(s, &f64s(&x), &f64s(&dy));
    let want: Vec<f64> = f64s(&dw0).iter().zip(&g).map(|(a, b)| a + b).collect();
    let (xd, dyd) = (upload(ctx, &x), upload(ctx, &dy));
    let what = format!("{} {} wgrad", describe(s), T::DTYPE);
    let mut dw = upload(ctx, &dw0);
    conv.backward_filter(&xd, &dyd, &mut dw, true)
        .expect("first call, accumulating");
    assert_accumulating_decision(&conv, wgrad, &what);
    let acc = conv.choice_for(wgrad, true).expect("decided");
    compare(
        &format!("{what} dw += auto -> {acc}"),
        &f64s(&download(ctx, &dw)),
        &want,
        tol(T::DTYPE),
    )
    .unwrap_or_else(|m| panic!("{m}"));
    let mut dw = poisoned::<T>(ctx, s.w_len().unwrap());
    conv.backward_filter(&xd, &dyd, &mut dw, false)
        .expect("first overwriting call");
    let over = conv
        .choice_for(wgrad, false)
        .expect("the overwriting decision");
    if let Some(r) = conv.report_for(wgrad, false) {
        assert!(
            !r.accumulate,
            "{what}: the overwriting decision measured adding:\n{r}"
        );
    }
    compare(
        &format!("{what} dw = auto -> {over}"),
        &f64s(&download(ctx, &dw)),
        &g,
        tol(T::DTYPE),
    )
    .unwrap_or_else(|m| panic!("{m}"));
    assert_eq!(
        conv.choice_for(wgrad, true).map(|c| c.route),
        Some(acc.route)
    );
    let mut dw = upload(ctx, &dw0);
    conv.backward_filter(&xd, &dyd, &mut dw, true)
        .expect("accumulating again");
    compare(
        &format!("{what} dw += again"),
        &f64s(&download(ctx, &dw)),
        &want,
        tol(T::DTYPE),
    )
    .unwrap_or_else(|m| panic!("{m}"));
    eprintln!("{what}: accumulating {acc}; overwriting {over}");
}

/// The filter gradient likewise: a first call that accumulates (a weight shared by several
/// layers) decides for accumulating calls, measured adding; an overwriting call decides on its
/// own; both are correct against f64.
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_accumulating_first_filter_gradient_call_decides_for_accumulating_calls() {
    let mut rng =
        Rng::fresh("an_accumulating_first_filter_gradient_call_decides_for_accumulating_calls");
    let ctx = gpu_with(Config {
        conv_tune_budget_ms: 0,
        ..Config::default()
    });
    for s in decision_shapes() {
        filter_gradient_decisions::<f16>(&ctx, &s, &mut rng);
        filter_gradient_decisions::<bf16>(&ctx, &s, &mut rng);
        filter_gradient_decisions::<f32>(&ctx, &s, &mut rng);
    }
    let nchw = square_conv(4, 32, 14, 48, 3, TensorFormat::Nchw);
    filter_gradient_decisions::<f32>(&ctx, &nchw, &mut rng);
}

/// Under the `winograd` policy the overwriting decision is a Winograd route, which cannot add:
/// an overwriting first call decides it; the first accumulating call then decides its own route
/// (one that can add, the plan's fallback, its notes saying why) with no substitute, and the
/// overwriting decision stays Winograd. Both results are correct.
#[test]
#[ignore = "needs a CUDA GPU"]
fn accumulating_calls_decide_a_route_that_adds_where_the_overwriting_one_cannot() {
    let mut rng =
        Rng::fresh("accumulating_calls_decide_a_route_that_adds_where_the_overwriting_one_cannot");
    let ctx = gpu_with(Config {
        conv_algo: ConvAlgoPolicy::Winograd,
        ..Config::default()
    });
    let dgrad = Direction::BackwardData;
    let s = square_conv(4, 64, 14, 64, 3, TensorFormat::Nhwc);
    let conv = Conv2d::<f16>::new(&ctx, &s).expect("plan");
    let plan = conv.plan_for(dgrad);
    assert!(
        plan.candidates
            .iter()
            .all(|r| plan.accumulate_refusal(r.path).is_some()),
        "the winograd policy's candidates are Winograd routes:\n{plan}"
    );
    let d = data::<f16>(&s, &mut rng);
    let (dyd, wd) = (upload(&ctx, &d.dy), upload(&ctx, &d.w));
    let g = backward_data(&s, &f64s(&d.dy), &f64s(&d.w));
    let mut dx = poisoned::<f16>(&ctx, s.x_len().unwrap());
    conv.backward_data(&dyd, &wd, &mut dx).expect("overwriting");
    let over = conv.choice_for(dgrad, false).expect("decided");
    assert!(over.route.path.winograd_tile().is_some(), "{over}");
    compare(
        &format!("dx = {over}"),
        &f64s(&download(&ctx, &dx)),
        &g,
        conv_tolerance(over.route.path, DType::F16),
    )
    .unwrap_or_else(|m| panic!("{m}"));
    assert!(conv.choice_for(dgrad, true).is_none());
    let mut dx = upload(&ctx, &d.dx0);
    conv.backward_data_into(&dyd, &wd, &mut dx, true)
        .expect("accumulating");
    let acc = conv.choice_for(dgrad, true).expect("decided");
    assert!(plan.accumulate_refusal(acc.route.path).is_none(), "{acc}");
    assert!(
        acc.notes
            .iter()
            .any(|n| n.contains("accumulating calls run") && n.contains("cannot add")),
        "{acc}: {:?}",
        acc.notes
    );
    compare(
        &format!("dx += {acc}"),
        &f64s(&download(&ctx, &dx)),
        &d.want,
        tol(DType::F16),
    )
    .unwrap_or_else(|m| panic!("{m}"));
    // The overwriting decision is untouched, and no longer carries a substitute's note.
    let again = conv.choice_for(dgrad, false).expect("decided");
    assert_eq!(again.route, over.route);
    assert!(
        !again.notes.iter().any(|n| n.contains("accumulating calls")),
        "{:?}",
        again.notes
    );
    assert_eq!(conv.choice(dgrad).map(|c| c.route), Some(over.route));
}
