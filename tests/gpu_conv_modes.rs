//! Process-wide convolution modes, in a test binary of their own (they change what every
//! `Conv2d` made afterwards plans): a machine without cuDNN (simulated), and cuDNN's Find as the
//! algorithm search. The tests here run one at a time and restore the modes when done.

mod common;
mod conv_ref;

use std::sync::Mutex;

use half::f16;
use nnfuse::config::{Config, ConvAlgoPolicy};
use nnfuse::conv::{self, ChoiceOrigin, Conv2d, ConvPath, ConvShape, CudnnSearch, Direction};
use nnfuse::internals::conv::check_tolerance;
use nnfuse::reference::conv::conv2d;
use nnfuse::{Context, DType, Element, TensorFormat};

use common::{download, f64s, gpu, gpu_with, poisoned, square_conv, upload, Rng};
use conv_ref::{backward_data, backward_filter, compare, describe};

static MODE_LOCK: Mutex<()> = Mutex::new(());

/// Restores the modes however the test ends.
struct Restore;

impl Drop for Restore {
    fn drop(&mut self) {
        nnfuse::internals::conv::simulate_missing_cudnn(false);
        conv::set_cudnn_search(CudnnSearch::Heuristic);
    }
}

fn tolerance(path: ConvPath, dtype: DType) -> f64 {
    if path.winograd_tile().is_some() {
        check_tolerance(dtype)
    } else {
        dtype.tolerance()
    }
}

fn shapes() -> [ConvShape; 3] {
    [
        square_conv(4, 32, 14, 48, 3, TensorFormat::Nhwc),
        ConvShape {
            n: 2,
            c_in: 30,
            h: 13,
            w: 11,
            c_out: 8,
            kh: 5,
            kw: 5,
            stride: (1, 1),
            pad: (2, 2),
            dilation: (1, 1),
            format: TensorFormat::Nchw,
        },
        ConvShape {
            n: 3,
            c_in: 3,
            h: 31,
            w: 31,
            c_out: 16,
            kh: 7,
            kw: 7,
            stride: (2, 2),
            pad: (3, 3),
            dilation: (1, 1),
            format: TensorFormat::Nhwc,
        },
    ]
}

/// Every direction under `auto` on one problem; returns the routes chosen.
fn all_directions<T: Element>(
    ctx: &Context,
    s: &ConvShape,
    rng: &mut Rng,
) -> Vec<(Direction, conv::ConvChoice)> {
    let xs: Vec<T> = rng.vec(s.x_len().unwrap(), -1.0, 1.0);
    let ws: Vec<T> = rng.vec(s.w_len().unwrap(), -1.0, 1.0);
    let dys: Vec<T> = rng.vec(s.y_len().expect("valid"), -1.0, 1.0);
    let (x, w, dy) = (f64s(&xs), f64s(&ws), f64s(&dys));
    let (xd, wd, dyd) = (upload(ctx, &xs), upload(ctx, &ws), upload(ctx, &dys));
    let conv = Conv2d::<T>::new(ctx, s).expect("plan");
    let tag = format!("{} {}", describe(s), T::DTYPE);
    let mut y = poisoned::<T>(ctx, s.y_len().expect("valid"));
    conv.forward(&xd, &wd, &mut y)
        .unwrap_or_else(|e| panic!("{tag} forward: {e}"));
    let mut dx = poisoned::<T>(ctx, s.x_len().unwrap());
    conv.backward_data(&dyd, &wd, &mut dx)
        .unwrap_or_else(|e| panic!("{tag} dx: {e}"));
    let mut dw = poisoned::<T>(ctx, s.w_len().unwrap());
    conv.backward_filter(&xd, &dyd, &mut dw, false)
        .unwrap_or_else(|e| panic!("{tag} dw: {e}"));
    let mut out = Vec::new();
    for (d, got, want) in [
        (
            Direction::Forward,
            &y,
            conv2d(s, &x, &w).expect("reference"),
        ),
        (Direction::BackwardData, &dx, backward_data(s, &dy, &w)),
        (Direction::BackwardFilter, &dw, backward_filter(s, &x, &dy)),
    ] {
        let c = conv.choice(d).expect("decided");
        let what = format!("{tag} {d} -> {c}");
        compare(
            &what,
            &f64s(&download(ctx, got)),
            &want,
            tolerance(c.route.path, T::DTYPE),
        )
        .unwrap_or_else(|m| panic!("{m}"));
        eprintln!("{what}");
        if let Some(r) = conv.report(d) {
            eprintln!("{r}");
        }
        out.push((d, c));
    }
    out
}

/// Without cuDNN every direction still runs, on nnfuse's own paths only.
#[test]
#[ignore = "needs a CUDA GPU"]
fn without_cudnn_everything_runs_on_own_paths() {
    let _l = MODE_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let _r = Restore;
    nnfuse::internals::conv::simulate_missing_cudnn(true);
    let ctx = gpu();
    let mut rng = Rng::fresh("no cuDNN");
    for s in shapes() {
        let conv = Conv2d::<f32>::new(&ctx, &s).expect("plan");
        for d in Direction::ALL {
            let p = conv.plan_for(d);
            assert!(!p.cudnn_present && !p.eligible(ConvPath::Cudnn), "{d}");
            assert!(
                p.candidates.iter().all(|r| r.path != ConvPath::Cudnn),
                "{p}"
            );
        }
        for (d, c) in all_directions::<f32>(&ctx, &s, &mut rng)
            .into_iter()
            .chain(all_directions::<f16>(&ctx, &s, &mut rng))
        {
            assert_ne!(c.route.path, ConvPath::Cudnn, "{} {d}", describe(&s));
        }
    }
    // Forcing cuDNN falls back too.
    let ctx = gpu_with(Config::default().with_conv_algo(ConvAlgoPolicy::Cudnn));
    let s = shapes()[1];
    let conv = Conv2d::<f32>::new(&ctx, &s).expect("plan");
    assert_eq!(conv.plan().path, ConvPath::Direct);
    assert!(conv.plan().fallback.is_some());
    all_directions::<f32>(&ctx, &s, &mut rng);
}

/// cuDNN's Find as the algorithm search: under the cuDNN policy the choice is Find's (no own
/// timing), under `auto` Find's algorithm is one candidate among the others.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cudnn_find_mode() {
    let _l = MODE_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let _r = Restore;
    conv::set_cudnn_search(CudnnSearch::Find);
    let mut rng = Rng::fresh("cuDNN Find");
    let forced = gpu_with(Config::default().with_conv_algo(ConvAlgoPolicy::Cudnn));
    let auto = gpu();
    for s in shapes() {
        let t = std::time::Instant::now();
        for (d, c) in all_directions::<f16>(&forced, &s, &mut rng) {
            assert_eq!(c.route.path, ConvPath::Cudnn, "{d}");
            assert!(c.route.cudnn_algo.is_some(), "{d}");
            assert!(
                matches!(c.origin, ChoiceOrigin::CudnnFind | ChoiceOrigin::Memory),
                "{d}: {:?}",
                c.origin
            );
        }
        eprintln!(
            "{}: Find for three directions in {:.1} ms",
            describe(&s),
            t.elapsed().as_secs_f64() * 1e3
        );
        for (d, _) in all_directions::<f16>(&auto, &s, &mut rng) {
            let c = Conv2d::<f16>::new(&auto, &s).expect("plan");
            if let Some(r) = c.report(d) {
                let cudnn = r
                    .candidates
                    .iter()
                    .filter(|c| c.route.path == ConvPath::Cudnn)
                    .count();
                assert!(cudnn <= 1, "Find gives one cuDNN candidate:\n{r}");
            }
        }
    }
}
