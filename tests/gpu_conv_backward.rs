//! The convolution gradients on the GPU: every path (forced) against f64 references on a
//! covering design (odd sizes, stride 2, dilation 2, asymmetric padding, C = 1/3/30/..., every
//! data type, both formats), the filter gradient's `accumulate`, path against path, the adjoint
//! identity on the GPU's own results, `auto` for both gradients, and deterministic mode.
//!
//! The f64 references are `tests/conv_ref` (written from the definition and checked here on the
//! CPU by the adjoint identity and finite differences). Tolerances as `tests/gpu_conv.rs`:
//! f32 1e-5, halves 1e-2; Winograd routes `nnfuse::reference::winograd::error_bound`.

mod common;
mod conv_ref;

use half::{bf16, f16};
use nnfuse::config::Config;
use nnfuse::conv::{Conv2d, ConvPath, ConvShape, Direction, Outcome, Route, WinogradEngine};
use nnfuse::internals::conv::{check_tolerance, usable};
use nnfuse::reference::conv::conv2d;
use nnfuse::{Context, DType, Element, TensorFormat};

use common::{
    conv_tolerance as tolerance, download, f64s, gpu, gpu_with, poisoned, resnet_stem,
    rounding_bound, same_bits, square_conv, upload, Rng,
};
use conv_ref::{backward_data, backward_filter, compare, describe, dot, par_map};

fn round(dt: DType, v: f64) -> f64 {
    match dt {
        DType::F32 => v as f32 as f64,
        DType::F16 => f16::from_f64(v).to_f64(),
        DType::BF16 => bf16::from_f64(v).to_f64(),
    }
}

/// Deterministic values in [-1, 1) for the CPU checks.
fn values(seed: u64, n: usize) -> Vec<f64> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.uniform(-1.0, 1.0)).collect()
}

fn small(format: TensorFormat) -> Vec<ConvShape> {
    let mut out = Vec::new();
    for (kh, kw, stride, pad, dilation) in [
        (3, 3, (1, 1), (1, 1), (1, 1)),
        (3, 2, (2, 1), (0, 1), (1, 2)),
        (1, 1, (2, 2), (0, 0), (1, 1)),
        (5, 3, (1, 2), (2, 0), (1, 1)),
        (3, 3, (1, 1), (2, 1), (2, 1)),
    ] {
        out.push(ConvShape {
            n: 2,
            c_in: 3,
            h: 7,
            w: 6,
            c_out: 4,
            kh,
            kw,
            stride,
            pad,
            dilation,
            format,
        });
    }
    out
}

/// The references satisfy the adjoint identity and match finite differences of the forward
/// (which is linear, so central differences are exact up to rounding). CPU only.
#[test]
fn references_are_adjoints_of_the_forward() {
    let mut seed = 1;
    for f in [TensorFormat::Nchw, TensorFormat::Nhwc] {
        for p in small(f) {
            seed += 3;
            let x = values(seed, p.x_len().unwrap());
            let w = values(seed + 1, p.w_len().unwrap());
            let dy = values(seed + 2, p.y_len().unwrap());
            let y = conv2d(&p, &x, &w).unwrap();
            let dx = backward_data(&p, &dy, &w);
            let dw = backward_filter(&p, &x, &dy);
            let a = dot(&y, &dy);
            assert!(
                (a - dot(&x, &dx)).abs() <= 1e-10 * a.abs().max(1.0),
                "{p:?}"
            );
            assert!(
                (a - dot(&w, &dw)).abs() <= 1e-10 * a.abs().max(1.0),
                "{p:?}"
            );
            // Finite differences: d<conv(x, w), dy>/dx_i = dx_i, likewise for w.
            for i in [0, x.len() / 2, x.len() - 1] {
                let mut xp = x.clone();
                xp[i] += 0.5;
                let mut xm = x.clone();
                xm[i] -= 0.5;
                let fd = dot(&conv2d(&p, &xp, &w).unwrap(), &dy)
                    - dot(&conv2d(&p, &xm, &w).unwrap(), &dy);
                assert!(
                    (fd - dx[i]).abs() <= 1e-9,
                    "{p:?} dx[{i}]: {fd} vs {}",
                    dx[i]
                );
            }
            for i in [0, w.len() / 3, w.len() - 1] {
                let mut wp = w.clone();
                wp[i] += 0.5;
                let mut wm = w.clone();
                wm[i] -= 0.5;
                let fd = dot(&conv2d(&p, &x, &wp).unwrap(), &dy)
                    - dot(&conv2d(&p, &x, &wm).unwrap(), &dy);
                assert!(
                    (fd - dw[i]).abs() <= 1e-9,
                    "{p:?} dw[{i}]: {fd} vs {}",
                    dw[i]
                );
            }
        }
    }
}

/// The gradient design: eight configurations (3x3 pad 1, 3x3 stride 2, 3x3 dilation 2 pad 2,
/// 5x5 pad 2, 1x1, 1x1 stride 2, 7x7/2 pad 3, an asymmetric 3x3 pad (2, 1)) times four problems
/// with odd sizes and C in {1, 3, 30, 64, 129}, rotating data type and format.
fn design() -> Vec<(ConvShape, DType)> {
    const NS: [usize; 4] = [1, 3, 2, 5];
    const CS: [usize; 5] = [1, 3, 30, 64, 129];
    const HW: [usize; 5] = [5, 7, 13, 31, 14];
    const BUDGET: usize = 20_000_000;
    #[allow(clippy::type_complexity)]
    let configs: [(
        (usize, usize),
        (usize, usize),
        (usize, usize),
        (usize, usize),
    ); 8] = [
        ((3, 3), (1, 1), (1, 1), (1, 1)),
        ((3, 3), (2, 2), (1, 1), (1, 1)),
        ((3, 3), (1, 1), (2, 2), (2, 2)),
        ((5, 5), (1, 1), (2, 2), (1, 1)),
        ((1, 1), (1, 1), (0, 0), (1, 1)),
        ((1, 1), (2, 2), (0, 0), (1, 1)),
        ((7, 7), (2, 2), (3, 3), (1, 1)),
        ((3, 3), (1, 1), (2, 1), (1, 1)),
    ];
    let mut out = Vec::new();
    for (k, &(kernel, stride, pad, dilation)) in configs.iter().enumerate() {
        for i in 0..4 {
            let mut s = ConvShape {
                n: NS[(i + k) % 4],
                c_in: CS[(i + k) % 5],
                h: HW[(2 * i + k) % 5],
                w: HW[(3 * i + 2 * k + 1) % 5],
                c_out: CS[(3 * i + k + 2) % 5],
                kh: kernel.0,
                kw: kernel.1,
                stride,
                pad,
                dilation,
                format: if (i + k) % 2 == 0 {
                    TensorFormat::Nhwc
                } else {
                    TensorFormat::Nchw
                },
            };
            let macs = |s: &ConvShape| {
                let (oh, ow) = s.out_hw().expect("valid");
                s.n * s.c_in * s.c_out * s.kh * s.kw * oh * ow
            };
            while macs(&s) > BUDGET {
                if s.n > 1 {
                    s.n -= 1;
                } else if s.c_in >= s.c_out {
                    s.c_in = s.c_in.div_ceil(2);
                } else {
                    s.c_out = s.c_out.div_ceil(2);
                }
            }
            out.push((s, DType::ALL[(i + 2 * k) % 3]));
        }
    }
    out
}

/// Routes of `d` the test forces (see `tests/gpu_conv.rs`).
fn routes<T: Element>(conv: &Conv2d<T>, ctx: &Context, d: Direction) -> Vec<Route> {
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
                let fused_ok = plan
                    .info(p)
                    .winograd
                    .as_ref()
                    .is_some_and(|w| w.fused_why_not.is_none());
                for e in WinogradEngine::ALL {
                    if e != WinogradEngine::Fused || fused_ok {
                        out.push(Route::winograd(tile, e));
                    }
                }
            }
            _ => out.push(Route::path(p)),
        }
    }
    out
}

struct Problem {
    s: ConvShape,
    dt: DType,
    x: Vec<f64>,
    w: Vec<f64>,
    dy: Vec<f64>,
    /// The starting dw for `accumulate`.
    dw0: Vec<f64>,
}

#[derive(Clone, Default)]
struct Refs {
    dx: Vec<f64>,
    dw: Vec<f64>,
}

fn run_problem<T: Element>(ctx: &Context, p: &Problem, r: &Refs) -> (Vec<String>, usize) {
    let s = &p.s;
    let cast = |v: &[f64]| -> Vec<T> { v.iter().map(|&a| T::from_f64(a)).collect() };
    let (xd, wd, dyd) = (
        upload(ctx, &cast(&p.x)),
        upload(ctx, &cast(&p.w)),
        upload(ctx, &cast(&p.dy)),
    );
    let conv = Conv2d::<T>::new(ctx, s).expect("plan");
    let mut failures = Vec::new();
    let mut runs = 0;
    let tag = format!("{} {}", describe(s), T::DTYPE);
    // Data gradient.
    let mut dxs: Vec<(Route, Vec<f64>)> = Vec::new();
    for route in routes(&conv, ctx, Direction::BackwardData) {
        let mut dx = poisoned::<T>(ctx, s.x_len().unwrap());
        let what = format!("{tag} dx via {route}");
        match conv.backward_data_with(route, &dyd, &wd, &mut dx) {
            Ok(()) => {
                let got = f64s(&download(ctx, &dx));
                if let Err(m) = compare(&what, &got, &r.dx, tolerance(route.path, T::DTYPE)) {
                    failures.push(m);
                }
                dxs.push((route, got));
                runs += 1;
            }
            Err(e) => failures.push(format!("{what}: the forced route failed: {e}")),
        }
    }
    // Filter gradient, overwritten and accumulated.
    let mut dws: Vec<(Route, Vec<f64>)> = Vec::new();
    for route in routes(&conv, ctx, Direction::BackwardFilter) {
        let mut dw = poisoned::<T>(ctx, s.w_len().unwrap());
        let what = format!("{tag} dw via {route}");
        match conv.backward_filter_with(route, &xd, &dyd, &mut dw, false) {
            Ok(()) => {
                let got = f64s(&download(ctx, &dw));
                if let Err(m) = compare(&what, &got, &r.dw, tolerance(route.path, T::DTYPE)) {
                    failures.push(m);
                }
                dws.push((route, got));
                runs += 1;
            }
            Err(e) => failures.push(format!("{what}: the forced route failed: {e}")),
        }
        let dw0: Vec<T> = cast(&p.dw0);
        let mut dw = upload(ctx, &dw0);
        let what = format!("{tag} dw += via {route}");
        match conv.backward_filter_with(route, &xd, &dyd, &mut dw, true) {
            Ok(()) => {
                // The starting dw as the GPU saw it (rounded to T).
                let want: Vec<f64> = f64s(&dw0).iter().zip(&r.dw).map(|(a, b)| a + b).collect();
                let got = f64s(&download(ctx, &dw));
                if let Err(m) = compare(&what, &got, &want, tolerance(route.path, T::DTYPE)) {
                    failures.push(m);
                }
                runs += 1;
            }
            Err(e) => failures.push(format!("{what}: the forced route failed: {e}")),
        }
    }
    // Path against path.
    for list in [&dxs, &dws] {
        for i in 0..list.len() {
            for j in i + 1..list.len() {
                let (ra, a) = &list[i];
                let (rb, b) = &list[j];
                let tol = tolerance(ra.path, T::DTYPE) + tolerance(rb.path, T::DTYPE);
                if let Err(m) = compare(&format!("{tag}: {ra} against {rb}"), a, b, tol) {
                    failures.push(m);
                }
            }
        }
    }
    // The adjoint identity on the GPU's own results: <y, dy> = <x, dx> = <w, dw>, relative to
    // |y| |dy| (the inner products themselves may cancel).
    let mut y = poisoned::<T>(ctx, s.y_len().expect("valid"));
    match conv.forward(&xd, &wd, &mut y) {
        Ok(()) => {
            let yg = f64s(&download(ctx, &y));
            let (xr, wr, dyr) = (f64s(&cast(&p.x)), f64s(&cast(&p.w)), f64s(&cast(&p.dy)));
            let scale = dot(&yg, &yg).sqrt() * dot(&dyr, &dyr).sqrt();
            let a = dot(&yg, &dyr);
            let tol = 3.0 * check_tolerance(T::DTYPE);
            for (name, v) in dxs
                .iter()
                .map(|(r, dx)| (format!("<x, dx via {r}>"), dot(&xr, dx)))
                .chain(
                    dws.iter()
                        .map(|(r, dw)| (format!("<w, dw via {r}>"), dot(&wr, dw))),
                )
            {
                let diff = (a - v).abs();
                if diff.is_nan() || diff > tol * scale {
                    failures.push(format!(
                        "{tag}: adjoint identity: <y, dy> = {a:.6e}, {name} = {v:.6e}, \
                         difference {:.3e} > {tol:.1e} x |y||dy| = {:.3e}",
                        (a - v).abs(),
                        tol * scale
                    ));
                }
            }
        }
        Err(e) => failures.push(format!("{tag}: forward for the adjoint check failed: {e}")),
    }
    (failures, runs)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_gradient_path_matches_the_f64_references() {
    let ctx = gpu();
    let mut rng = Rng::fresh("conv backward grid");
    let problems: Vec<Problem> = design()
        .into_iter()
        .map(|(s, dt)| {
            let mut v = |n: usize| -> Vec<f64> {
                (0..n).map(|_| round(dt, rng.uniform(-1.0, 1.0))).collect()
            };
            let x = v(s.x_len().unwrap());
            let w = v(s.w_len().unwrap());
            let dy = v(s.y_len().expect("valid"));
            let dw0 = v(s.w_len().unwrap());
            Problem {
                s,
                dt,
                x,
                w,
                dy,
                dw0,
            }
        })
        .collect();
    let t = std::time::Instant::now();
    let refs: Vec<Refs> = par_map(&problems, |p| Refs {
        dx: backward_data(&p.s, &p.dy, &p.w),
        dw: backward_filter(&p.s, &p.x, &p.dy),
    });
    eprintln!(
        "{} problems, f64 references in {:.1} s",
        problems.len(),
        t.elapsed().as_secs_f64()
    );
    let mut failures = Vec::new();
    let mut runs = 0;
    for (p, r) in problems.iter().zip(&refs) {
        let (f, n) = match p.dt {
            DType::F32 => run_problem::<f32>(&ctx, p, r),
            DType::F16 => run_problem::<f16>(&ctx, p, r),
            DType::BF16 => run_problem::<bf16>(&ctx, p, r),
        };
        failures.extend(f);
        runs += n;
    }
    eprintln!("{runs} gradient route runs");
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// `auto` for both gradients: a route that passed its check, correct results; in deterministic
/// mode the cuDNN choice is a deterministic algorithm and two runs agree bit for bit.
#[test]
#[ignore = "needs a CUDA GPU"]
fn auto_gradients_and_determinism() {
    let mut rng = Rng::fresh("conv backward auto");
    for deterministic in [false, true] {
        let ctx = gpu_with(Config::default().with_deterministic(deterministic));
        for s in [
            square_conv(4, 64, 14, 64, 3, TensorFormat::Nhwc),
            ConvShape {
                n: 3,
                c_in: 30,
                h: 15,
                w: 13,
                c_out: 24,
                kh: 3,
                kw: 3,
                stride: (2, 2),
                pad: (1, 1),
                dilation: (1, 1),
                format: TensorFormat::Nchw,
            },
        ] {
            auto_once::<f16>(&ctx, &s, &mut rng, deterministic);
            auto_once::<f32>(&ctx, &s, &mut rng, deterministic);
        }
    }
}

fn auto_once<T: Element>(ctx: &Context, s: &ConvShape, rng: &mut Rng, deterministic: bool) {
    let xs: Vec<T> = rng.vec(s.x_len().unwrap(), -1.0, 1.0);
    let ws: Vec<T> = rng.vec(s.w_len().unwrap(), -1.0, 1.0);
    let dys: Vec<T> = rng.vec(s.y_len().expect("valid"), -1.0, 1.0);
    let (x, w, dy) = (f64s(&xs), f64s(&ws), f64s(&dys));
    let want_dx = backward_data(s, &dy, &w);
    let want_dw = backward_filter(s, &x, &dy);
    let (xd, wd, dyd) = (upload(ctx, &xs), upload(ctx, &ws), upload(ctx, &dys));
    let conv = Conv2d::<T>::new(ctx, s).expect("plan");
    let tag = format!("{} {} det={deterministic}", describe(s), T::DTYPE);
    let mut dx = poisoned::<T>(ctx, s.x_len().unwrap());
    conv.backward_data(&dyd, &wd, &mut dx)
        .expect("auto backward data");
    let mut dw = poisoned::<T>(ctx, s.w_len().unwrap());
    conv.backward_filter(&xd, &dyd, &mut dw, false)
        .expect("auto backward filter");
    for (d, got, want) in [
        (Direction::BackwardData, f64s(&download(ctx, &dx)), &want_dx),
        (
            Direction::BackwardFilter,
            f64s(&download(ctx, &dw)),
            &want_dw,
        ),
    ] {
        let c = conv.choice(d).expect("decided");
        let what = format!("{tag} {d} auto -> {c}");
        compare(&what, &got, want, tolerance(c.route.path, T::DTYPE))
            .unwrap_or_else(|m| panic!("{m}"));
        eprintln!("{what}");
        if let Some(rep) = conv.report(d) {
            eprintln!("{rep}");
            assert_eq!(rep.candidates[rep.winner].outcome, Outcome::Passed, "{rep}");
        }
        if deterministic {
            if let Some(a) = c.route.cudnn_algo {
                let list = conv.cudnn_heuristics(d).expect("heuristics");
                let entry = list
                    .iter()
                    .find(|p| p.algo == a)
                    .expect("the chosen algorithm is listed");
                assert!(entry.deterministic, "{what}: {a} is not deterministic");
            }
        }
    }
    if deterministic {
        // Bit-for-bit repeatable.
        let mut dw2 = poisoned::<T>(ctx, s.w_len().unwrap());
        conv.backward_filter(&xd, &dyd, &mut dw2, false)
            .expect("again");
        let mut dx2 = poisoned::<T>(ctx, s.x_len().unwrap());
        conv.backward_data(&dyd, &wd, &mut dx2).expect("again");
        let bits = |v: Vec<T>| v.iter().map(|t| t.to_f64().to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(download(ctx, &dw)),
            bits(download(ctx, &dw2)),
            "{tag}: dw differs run to run"
        );
        assert_eq!(
            bits(download(ctx, &dx)),
            bits(download(ctx, &dx2)),
            "{tag}: dx differs run to run"
        );
    }
}

/// A 3x3 stride-1 problem.
fn conv3(
    n: usize,
    c_in: usize,
    (h, w): (usize, usize),
    c_out: usize,
    pad: (usize, usize),
    format: TensorFormat,
) -> ConvShape {
    ConvShape {
        n,
        c_in,
        h,
        w,
        c_out,
        kh: 3,
        kw: 3,
        stride: (1, 1),
        pad,
        dilation: (1, 1),
        format,
    }
}

/// Forces f32 filter-gradient `route` on each of `shapes` (where the plan must call it
/// eligible) against f64, overwriting and adding into dw; bit-identical run to run when
/// `deterministic`; within the sum of both tolerances of cuDNN's result. Returns the failures.
fn check_filter_route(
    ctx: &Context,
    rng: &mut Rng,
    route: Route,
    shapes: &[ConvShape],
    deterministic: bool,
) -> Vec<String> {
    let mut failures = Vec::new();
    for s in shapes {
        let xs: Vec<f32> = rng.vec(s.x_len().unwrap(), -1.0, 1.0);
        let dys: Vec<f32> = rng.vec(s.y_len().unwrap(), -1.0, 1.0);
        let dw0s: Vec<f32> = rng.vec(s.w_len().unwrap(), -1.0, 1.0);
        let want = backward_filter(s, &f64s(&xs), &f64s(&dys));
        let (xd, dyd) = (upload(ctx, &xs), upload(ctx, &dys));
        let conv = Conv2d::<f32>::new(ctx, s).expect("plan");
        let plan = conv.plan_for(Direction::BackwardFilter);
        assert!(plan.eligible(route.path), "{plan}");
        let tag = format!("{} f32 dw via {route}", describe(s));
        let tol = tolerance(route.path, DType::F32);
        let mut runs = Vec::new();
        for _ in 0..2 {
            let mut dw = poisoned::<f32>(ctx, s.w_len().unwrap());
            conv.backward_filter_with(route, &xd, &dyd, &mut dw, false)
                .unwrap_or_else(|e| panic!("{tag}: {e}"));
            runs.push(download(ctx, &dw));
        }
        let got = f64s(&runs[0]);
        if let Err(m) = compare(&tag, &got, &want, tol) {
            failures.push(m);
        }
        let bits = |v: &[f32]| v.iter().map(|t| t.to_bits()).collect::<Vec<_>>();
        if deterministic && bits(&runs[0]) != bits(&runs[1]) {
            failures.push(format!("{tag}: differs run to run"));
        }
        let mut dw = upload(ctx, &dw0s);
        conv.backward_filter_with(route, &xd, &dyd, &mut dw, true)
            .unwrap_or_else(|e| panic!("{tag} (accumulate): {e}"));
        let want_acc: Vec<f64> = f64s(&dw0s).iter().zip(&want).map(|(a, b)| a + b).collect();
        if let Err(m) = compare(
            &format!("{tag} +="),
            &f64s(&download(ctx, &dw)),
            &want_acc,
            tol,
        ) {
            failures.push(m);
        }
        let mut dwc = poisoned::<f32>(ctx, s.w_len().unwrap());
        conv.backward_filter_with(Route::path(ConvPath::Cudnn), &xd, &dyd, &mut dwc, false)
            .unwrap_or_else(|e| panic!("{tag}: cuDNN: {e}"));
        if let Err(m) = compare(
            &format!("{tag} against cudnn"),
            &got,
            &f64s(&download(ctx, &dwc)),
            tol + tolerance(ConvPath::Cudnn, DType::F32),
        ) {
            failures.push(m);
        }
        eprintln!("{tag}: checked");
    }
    failures
}

/// nnfuse's filter-gradient kernel (`direct_filter`: f32, 3x3, stride 1) against f64 on shapes
/// that reach every edge of its tiling — rows wider than one 64-column segment (two and three
/// segments), filters past one 64-filter tile (129), channels not a multiple of 32 (3, 17, 30,
/// 33), zero and asymmetric padding, fewer work units than splits — in both formats,
/// overwriting and adding into dw; bit-identical run to run (partial sums added in a fixed
/// order), and within the sum of both tolerances of cuDNN's result. The plan refuses it for
/// f16.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_filter_gradient_kernel_matches_f64_on_its_tile_edges() {
    let ctx = gpu();
    let mut rng = Rng::fresh("direct filter gradient");
    let shapes = [
        conv3(2, 30, (70, 70), 129, (1, 1), TensorFormat::Nchw),
        conv3(3, 17, (9, 130), 5, (0, 2), TensorFormat::Nhwc),
        conv3(1, 64, (56, 56), 64, (2, 1), TensorFormat::Nchw),
        conv3(4, 3, (5, 6), 7, (1, 1), TensorFormat::Nhwc),
        conv3(2, 33, (12, 65), 70, (1, 0), TensorFormat::Nhwc),
    ];
    let route = Route::path(ConvPath::DirectFilter);
    let failures = check_filter_route(&ctx, &mut rng, route, &shapes, true);
    let s = conv3(2, 16, (8, 8), 16, (1, 1), TensorFormat::Nhwc);
    let conv = Conv2d::<f16>::new(&ctx, &s).expect("plan");
    let plan = conv.plan_for(Direction::BackwardFilter);
    assert!(!plan.eligible(ConvPath::DirectFilter), "{plan}");
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The filter gradient over 2x2 tiles (`cudnn_tiled`) against f64 on odd and even outputs of
/// at least 32x32 (the last quarter's rows and columns past the output, zero padding, padding
/// 2 with a 5x5 filter, a 1x1 filter), both formats, overwriting and adding into dw, and
/// against cuDNN's own filter gradient; a forced route is checked once against a true-f32
/// route and then runs. The plan refuses it below 32x32.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_tiled_filter_gradient_matches_f64() {
    let ctx = gpu();
    let mut rng = Rng::fresh("tiled filter gradient");
    let mut shapes = vec![
        conv3(2, 30, (33, 35), 17, (1, 1), TensorFormat::Nchw),
        conv3(3, 16, (34, 40), 24, (0, 0), TensorFormat::Nhwc),
        conv3(1, 64, (56, 56), 64, (1, 1), TensorFormat::Nchw),
    ];
    shapes.push(ConvShape {
        kh: 5,
        kw: 5,
        pad: (2, 2),
        ..conv3(2, 8, (36, 33), 12, (0, 0), TensorFormat::Nhwc)
    });
    shapes.push(ConvShape {
        kh: 1,
        kw: 1,
        ..conv3(2, 24, (32, 37), 20, (0, 0), TensorFormat::Nchw)
    });
    let route = Route::path(ConvPath::CudnnTiled);
    let failures = check_filter_route(&ctx, &mut rng, route, &shapes, false);
    // Forced: the check once, then the route.
    let forced =
        gpu_with(Config::default().with_conv_algo(nnfuse::config::ConvAlgoPolicy::CudnnTiled));
    let s = shapes[2];
    let xs: Vec<f32> = rng.vec(s.x_len().unwrap(), -1.0, 1.0);
    let dys: Vec<f32> = rng.vec(s.y_len().unwrap(), -1.0, 1.0);
    let want = backward_filter(&s, &f64s(&xs), &f64s(&dys));
    let conv = Conv2d::<f32>::new(&forced, &s).expect("plan");
    let mut dw = poisoned::<f32>(&forced, s.w_len().unwrap());
    conv.backward_filter(
        &upload(&forced, &xs),
        &upload(&forced, &dys),
        &mut dw,
        false,
    )
    .expect("forced cudnn_tiled");
    let c = conv.choice(Direction::BackwardFilter).expect("decided");
    assert_eq!(c.route.path, ConvPath::CudnnTiled, "{c}\n{:?}", c.notes);
    compare(
        "forced cudnn_tiled",
        &f64s(&download(&forced, &dw)),
        &want,
        1e-5,
    )
    .unwrap_or_else(|m| panic!("{m}"));
    let small = conv3(2, 16, (28, 28), 16, (1, 1), TensorFormat::Nchw);
    let conv = Conv2d::<f32>::new(&ctx, &small).expect("plan");
    let plan = conv.plan_for(Direction::BackwardFilter);
    assert!(!plan.eligible(ConvPath::CudnnTiled), "{plan}");
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Forces the stem filter-gradient route on `s` in `T` against f64: overwriting (twice:
/// bit-identical, partial sums added in a fixed order) and adding into dw. Its error may not
/// exceed 1.5x that of rounding the exact result to `T` (+1e-5): f32 accumulation throughout,
/// which the dtype tolerance alone would not show. Returns the failures.
fn check_stem_route<T: Element>(ctx: &Context, rng: &mut Rng, s: &ConvShape) -> Vec<String> {
    let mut failures = Vec::new();
    let route = Route::path(ConvPath::StemFilter);
    let xs: Vec<T> = rng.vec(s.x_len().unwrap(), -1.0, 1.0);
    let dys: Vec<T> = rng.vec(s.y_len().unwrap(), -1.0, 1.0);
    let dw0s: Vec<T> = rng.vec(s.w_len().unwrap(), -1.0, 1.0);
    let want = backward_filter(s, &f64s(&xs), &f64s(&dys));
    let want_acc: Vec<f64> = f64s(&dw0s).iter().zip(&want).map(|(a, b)| a + b).collect();
    let conv = Conv2d::<T>::new(ctx, s).expect("plan");
    let plan = conv.plan_for(Direction::BackwardFilter);
    assert!(plan.eligible(ConvPath::StemFilter), "{plan}");
    let tag = format!("{} {} dw via {route}", describe(s), T::DTYPE);
    let (xd, dyd) = (upload(ctx, &xs), upload(ctx, &dys));
    let mut runs = Vec::new();
    for _ in 0..2 {
        let mut dw = poisoned::<T>(ctx, s.w_len().unwrap());
        conv.backward_filter_with(route, &xd, &dyd, &mut dw, false)
            .unwrap_or_else(|e| panic!("{tag}: {e}"));
        runs.push(download(ctx, &dw));
    }
    let mut dw = upload(ctx, &dw0s);
    conv.backward_filter_with(route, &xd, &dyd, &mut dw, true)
        .unwrap_or_else(|e| panic!("{tag} (accumulate): {e}"));
    let acc = download(ctx, &dw);
    for (what, got, want) in [("", &runs[0], &want), (" +=", &acc, &want_acc)] {
        let (floor, bound) = rounding_bound::<T>(want, ConvPath::StemFilter);
        match compare(&format!("{tag}{what}"), &f64s(got), want, bound) {
            Ok(e) => eprintln!("{tag}{what}: error {e:.2e} (rounding alone {floor:.2e})"),
            Err(m) => failures.push(m),
        }
    }
    if !same_bits(&runs[0], &runs[1]) {
        failures.push(format!("{tag}: differs run to run"));
    }
    failures
}

/// nnfuse's stem filter-gradient kernel (`stem_filter`: f16 / bf16 channels-last, few input
/// channels) against f64 on shapes that reach every edge of its tiling — ResNet-50's 7x7/2 stem
/// (one 112-pixel segment per row), rows of three 128-pixel segments with a partial last one
/// (not a multiple of 16), 160 columns exactly (five column tiles per warp) and 2 (one), filters
/// past one 64-filter tile (136) and 8, asymmetric stride and padding, odd heights, fewer work
/// units than splits — overwriting and adding into dw, run to run bit-identical; a forced
/// policy takes it, and the plan refuses f32, NCHW and a wide layer with the reason.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_stem_filter_gradient_matches_f64_on_its_tile_edges() {
    let ctx = gpu();
    let mut rng = Rng::fresh("stem filter gradient");
    let nhwc = TensorFormat::Nhwc;
    let stem = resnet_stem(2);
    let shapes = [
        stem,
        conv3(1, 3, (5, 300), 24, (1, 1), nhwc),
        ConvShape {
            kh: 4,
            kw: 4,
            pad: (1, 2),
            ..conv3(2, 10, (19, 33), 136, (0, 0), nhwc)
        },
        ConvShape {
            kh: 1,
            kw: 1,
            stride: (2, 1),
            ..conv3(3, 2, (9, 17), 8, (0, 0), nhwc)
        },
        ConvShape {
            kh: 5,
            kw: 3,
            stride: (1, 3),
            pad: (2, 0),
            ..conv3(2, 4, (11, 140), 72, (0, 0), nhwc)
        },
        ConvShape {
            stride: (2, 2),
            ..conv3(1, 16, (3, 4), 16, (1, 1), nhwc)
        },
    ];
    let mut failures = Vec::new();
    for s in &shapes {
        failures.extend(check_stem_route::<f16>(&ctx, &mut rng, s));
        failures.extend(check_stem_route::<bf16>(&ctx, &mut rng, s));
    }
    // Forced by the policy: the route runs without a measurement.
    let forced =
        gpu_with(Config::default().with_conv_algo(nnfuse::config::ConvAlgoPolicy::StemFilter));
    let s = shapes[1];
    let conv = Conv2d::<f16>::new(&forced, &s).expect("plan");
    let xs: Vec<f16> = rng.vec(s.x_len().unwrap(), -1.0, 1.0);
    let dys: Vec<f16> = rng.vec(s.y_len().unwrap(), -1.0, 1.0);
    let mut dw = poisoned::<f16>(&forced, s.w_len().unwrap());
    conv.backward_filter(
        &upload(&forced, &xs),
        &upload(&forced, &dys),
        &mut dw,
        false,
    )
    .expect("forced stem_filter");
    let c = conv.choice(Direction::BackwardFilter).expect("decided");
    assert_eq!(c.route.path, ConvPath::StemFilter, "{c}\n{:?}", c.notes);
    compare(
        "forced stem_filter",
        &f64s(&download(&forced, &dw)),
        &backward_filter(&s, &f64s(&xs), &f64s(&dys)),
        1e-2,
    )
    .unwrap_or_else(|m| panic!("{m}"));
    let why = |s: &ConvShape, dt: DType| {
        let ineligible = |plan: &nnfuse::conv::ConvPlan| {
            assert!(!plan.eligible(ConvPath::StemFilter), "{plan}");
            plan.info(ConvPath::StemFilter)
                .why_not
                .clone()
                .unwrap_or_default()
        };
        match dt {
            DType::F32 => ineligible(
                Conv2d::<f32>::new(&ctx, s)
                    .expect("plan")
                    .plan_for(Direction::BackwardFilter),
            ),
            _ => ineligible(
                Conv2d::<f16>::new(&ctx, s)
                    .expect("plan")
                    .plan_for(Direction::BackwardFilter),
            ),
        }
    };
    assert!(why(&stem, DType::F32).contains("f16 and bf16 only"));
    let nchw = ConvShape {
        format: TensorFormat::Nchw,
        ..stem
    };
    assert!(why(&nchw, DType::F16).contains("channels-last"));
    let wide = ConvShape { c_in: 4, ..stem };
    assert!(why(&wide, DType::F16).contains("196 columns"));
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
