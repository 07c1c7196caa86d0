//! `nnfuse plan --conv` on the cuDNN API: which API the cuDNN candidate uses and why, from
//! `--cudnn-api`, `NNFUSE_CUDNN_API` or the default, and a bad value naming the flag or the
//! variable. Needs no GPU.

mod common;

use common::{nnfuse_binary as binary, run_nnfuse};
use std::process::{Command, Output};

use serde_json::Value;

/// Runs `nnfuse plan ARGS` with nnfuse's variables cleared, then `env` set.
fn nnfuse_plan(args: &[&str], env: &[(&str, &str)]) -> Output {
    let cleared = ["NNFUSE_LOG", nnfuse::conv::ENV_CONV_CUDNN_SEARCH];
    run_nnfuse(&[&["plan"], args].concat(), &cleared, env)
}

const PROBLEM: &[&str] = &[
    "--conv",
    "8,64,28,28,64,3,3",
    "--pad",
    "1",
    "--format",
    "nhwc",
    "--dtype",
    "f16",
    "--cudnn",
    "present",
];

fn json(extra: &[&str], env: &[(&str, &str)]) -> Value {
    let args = [PROBLEM, extra, &["--json"]].concat();
    let out = nnfuse_plan(&args, env);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// Whether a present cuDNN has the graph API here: detected when cuDNN loads, else assumed.
fn graph_here() -> bool {
    !nnfuse::context::cudnn_present() || nnfuse::internals::cudnn_graph::available().is_ok()
}

#[test]
fn the_plan_says_which_cudnn_api_and_why() {
    let v = json(&[], &[]);
    assert_eq!(v["cudnn_api"], "auto");
    assert_eq!(v["sources"]["cudnn_api"], "default");
    assert_eq!(v["path"], "cudnn");
    let used = if graph_here() { "graph" } else { "legacy" };
    assert_eq!(v["cudnn_api_used"], used, "{v}");
    if !nnfuse::context::cudnn_present() {
        assert_eq!(v["sources"]["cudnn_graph"], "assumed (cuDNN 9.19)");
    }
    let reasons = v["reasons"].to_string();
    assert!(reasons.contains(&format!("cuDNN API {used}")), "{reasons}");

    // The variable, then the flag over it.
    let v = json(&[], &[("NNFUSE_CUDNN_API", "legacy")]);
    assert_eq!(v["cudnn_api"], "legacy");
    assert_eq!(v["cudnn_api_used"], "legacy");
    assert_eq!(v["sources"]["cudnn_api"], "NNFUSE_CUDNN_API");
    assert_eq!(v["api_paths"][0]["eligible"], false);
    let v = json(&["--cudnn-api", "graph"], &[("NNFUSE_CUDNN_API", "legacy")]);
    assert_eq!(v["cudnn_api"], "graph");
    assert_eq!(v["sources"]["cudnn_api"], "--cudnn-api");

    // Without cuDNN there is no API to use.
    let args = [&PROBLEM[..8], &["--cudnn", "absent", "--json"]].concat();
    let out = nnfuse_plan(&args, &[]);
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert!(v["cudnn_api_used"].is_null(), "{v}");

    // The text says it too.
    let out = nnfuse_plan(PROBLEM, &[("NNFUSE_CUDNN_API", "legacy")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("cuDNN API legacy (legacy)"), "{text}");
    assert!(
        text.contains("cuDNN API legacy (NNFUSE_CUDNN_API"),
        "{text}"
    );
}

#[test]
fn bad_cudnn_api_values_exit_2_naming_them() {
    let out = nnfuse_plan(&[PROBLEM, &["--cudnn-api", "backend"]].concat(), &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--cudnn-api"));
    let out = nnfuse_plan(PROBLEM, &[("NNFUSE_CUDNN_API", "backend")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("NNFUSE_CUDNN_API"));
    let help = Command::new(binary())
        .args(["plan", "--help"])
        .output()
        .expect("runs");
    assert!(String::from_utf8_lossy(&help.stdout).contains("--cudnn-api"));
}

/// `nnfuse plan --conv --dtype f32` on a cuDNN with the graph API: the cuDNN candidate goes
/// through it for f32 too, and the reasons say what that means (true f32, each engine config
/// checked against a true-f32 route within a bound), in the text and the JSON.
#[test]
fn f32_plans_take_the_graph_api_and_say_it_means_true_f32() {
    let f32_problem: Vec<&str> = PROBLEM
        .iter()
        .map(|&a| if a == "f16" { "f32" } else { a })
        .collect();
    for direction in ["forward", "backward-data", "backward-filter"] {
        let args = [&f32_problem[..], &["--direction", direction, "--json"]].concat();
        let out = nnfuse_plan(&args, &[]);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
        assert_eq!(v["dtype"], "f32", "{v}");
        let reasons = v["reasons"].to_string();
        if graph_here() {
            assert_eq!(v["cudnn_api_used"], "graph", "{direction}: {v}");
            assert_eq!(v["api_paths"][0]["eligible"], true, "{direction}: {v}");
            assert!(
                reasons.contains("cudnn_graph f32 means true f32"),
                "{direction}: {reasons}"
            );
            assert!(reasons.contains("true-f32 route"), "{direction}: {reasons}");
        }
        let text = nnfuse_plan(
            &[&f32_problem[..], &["--direction", direction]].concat(),
            &[],
        );
        let text = String::from_utf8_lossy(&text.stdout);
        if graph_here() {
            assert!(text.contains("cudnn_graph f32 means true f32"), "{text}");
        }
    }
}
