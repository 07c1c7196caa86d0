//! The tuning file's Winograd entries on the GPU: a Winograd route read back from the file goes
//! through the accuracy check a measurement applies (the reference, the check, the allowance
//! against the non-Winograd baseline) before it is used, and is measured again if it fails
//! (docs/CONV.md, "The tuning file"). Whether it passes depends on the data: either way the check
//! must have run, which the choice's report shows.

mod common;

use half::f16;
use nnfuse::config::Config;
use nnfuse::conv::{self, ChoiceOrigin, Conv2d, ConvShape, Direction, Outcome, Route};
use nnfuse::{Context, TensorFormat};

use common::{gpu_with, poisoned, square_conv, upload, Rng};

/// One forward of `s` in f16 on `ctx` (fresh object per Context), its inputs from `rng`.
fn forward(ctx: &Context, s: &ConvShape, rng: &mut Rng) -> Conv2d<f16> {
    // Element counts from the fields (x and w), the output from the shape.
    let xs: Vec<f16> = rng.vec(s.n * s.c_in * s.h * s.w, -1.0, 1.0);
    let ws: Vec<f16> = rng.vec(s.c_out * s.c_in * s.kh * s.kw, -1.0, 1.0);
    let (xd, wd) = (upload(ctx, &xs), upload(ctx, &ws));
    let conv = Conv2d::<f16>::new(ctx, s).expect("plan");
    let mut y = poisoned::<f16>(ctx, s.y_len().expect("valid"));
    conv.forward(&xd, &wd, &mut y).expect("forward");
    ctx.synchronize().expect("sync");
    conv
}

/// Rewrites the file's forward f16 entry of `s` to choose `route`; returns how many it rewrote.
fn rewrite_entry(file: &std::path::Path, s: &ConvShape, route: Route) -> usize {
    let text = std::fs::read_to_string(file).expect("the tuning file exists");
    let mut doc: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let mut n = 0;
    for sec in doc["conv"]["sections"].as_array_mut().expect("sections") {
        for e in sec["entries"].as_array_mut().expect("entries") {
            let k = &e["key"];
            if k["direction"] == "forward" && k["dtype"] == "f16" && k["n"] == s.n {
                let c = e["choice"].as_object_mut().expect("choice");
                c.insert("path".into(), route.path.name().into());
                c.insert("engine".into(), route.engine.map(|g| g.name()).into());
                c.insert("cudnn_algo".into(), serde_json::Value::Null);
                c.insert("cudnn_math".into(), serde_json::Value::Null);
                c.remove("graph_engine");
                n += 1;
            }
        }
    }
    std::fs::write(file, serde_json::to_string_pretty(&doc).expect("JSON")).expect("write");
    n
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_winograd_route_from_the_file_is_checked_before_use() {
    let dir = std::env::temp_dir().join(format!("nnfuse-gpu-conv-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("tuning.json");
    let _ = std::fs::remove_file(&file);
    let cfg = Config::default().with_tuning_cache(Some(file.clone()));
    let s = square_conv(8, 64, 28, 64, 3, TensorFormat::Nhwc);
    let mut rng = Rng::fresh("conv file winograd");

    // 1. A measurement writes the problem's entry.
    let ctx = gpu_with(cfg.clone());
    let conv = forward(&ctx, &s, &mut rng);
    assert!(conv.plan().measured, "{}", conv.plan());
    let winograd = *conv
        .plan()
        .candidates
        .iter()
        .find(|r| r.path.winograd_tile().is_some())
        .expect("a Winograd candidate");

    // 2. The file now names the Winograd route (as an edited or foreign file may).
    assert_eq!(rewrite_entry(&file, &s, winograd), 1);

    // 3. A fresh process cache reads the file: the route is checked before use.
    conv::clear_choices();
    let ctx2 = gpu_with(cfg);
    let conv2 = forward(&ctx2, &s, &mut rng);
    let c = conv2.choice(Direction::Forward).expect("decided");
    let rep = conv2
        .report(Direction::Forward)
        .expect("the file's Winograd route was checked: a report");
    eprintln!("{c}\n{rep}");
    let cand = rep
        .candidates
        .iter()
        .find(|r| r.route == winograd)
        .expect("the file's route is in the report");
    assert!(
        cand.rel_l2.is_some(),
        "the route was run and compared: {rep}"
    );
    assert!(
        rep.baseline_error.is_some(),
        "a baseline was checked: {rep}"
    );
    if cand.outcome == Outcome::Passed {
        assert_eq!(c.origin, ChoiceOrigin::File, "{rep}");
        assert_eq!(c.route, winograd);
        assert_eq!(rep.rounds, 0, "a check, not a measurement: {rep}");
        assert_eq!(rep.candidates[rep.winner].route, winograd);
    } else {
        // Refused or failed: measured again, and not the refused route.
        assert_eq!(c.origin, ChoiceOrigin::Measured, "{rep}");
        assert_ne!(c.route, winograd, "{rep}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
