//! `nnfuse plan` as a user runs it: the built binary, its JSON, its exit codes, and the
//! environment variables it shares with the library. Needs no GPU.

mod common;

use common::{exits_2_naming as fails_naming, plan_json, run_nnfuse};
use std::process::Output;

use serde_json::Value;

/// Runs `nnfuse plan ARGS` with nnfuse's variables cleared, then `env` set.
fn nnfuse_plan(args: &[&str], env: &[(&str, &str)]) -> Output {
    run_nnfuse(&[&["plan"], args].concat(), &["NNFUSE_LOG"], env)
}

/// Runs with `--json` (and a fixed cuDNN version) and parses stdout as exactly one JSON object.
fn json(args: &[&str], env: &[(&str, &str)]) -> Value {
    let mut all = args.to_vec();
    all.extend(["--json", "--cudnn-version", "91900"]);
    plan_json(&all, &nnfuse_plan(&all, env))
}

fn codes(v: &Value) -> Vec<&str> {
    v["refusals"]
        .as_array()
        .expect("refusals is a list")
        .iter()
        .map(|c| c.as_str().expect("codes are strings"))
        .collect()
}

#[test]
fn channels_last_f16_add_relu_is_fused() {
    let v = json(
        &[
            "--shape",
            "64,56,56,256",
            "--axis",
            "3",
            "--dtype",
            "f16",
            "--fuse",
            "add-relu",
            "--impl",
            "cudnn",
        ],
        &[],
    );
    assert_eq!(v["path"], "cudnn_fused");
    assert_eq!(v["mode"], "spatial_persistent");
    assert_eq!(v["format"], "nhwc");
    assert_eq!((v["n"].as_i64(), v["c"].as_i64()), (Some(64), Some(256)));
    assert_eq!((v["h"].as_i64(), v["w"].as_i64()), (Some(3136), Some(1)));
    assert_eq!(v["api"], "ex");
    assert_eq!(v["fuse"], "add_relu");
    assert_eq!(v["phase"], "training");
    assert_eq!(v["dtype"], "f16");
    assert_eq!(v["policy"], "auto");
    assert_eq!(v["cudnn_version"], 91900);
    assert_eq!(v["shape"], serde_json::json!([64, 56, 56, 256]));
    assert_eq!(v["axis"], 3);
    assert!(codes(&v).is_empty());
    let reasons = v["reasons"].as_array().expect("reasons is a list");
    assert!(reasons.iter().all(Value::is_string));
    assert!(reasons.iter().any(|r| r
        .as_str()
        .is_some_and(|r| r.contains("departs from OneFlow"))));
}

#[test]
fn channels_first_default_policy_falls_back() {
    let v = json(
        &[
            "--shape",
            "16,32,112,112",
            "--axis",
            "1",
            "--dtype",
            "f16",
            "--fuse",
            "add-relu",
            "--impl",
            "cudnn",
        ],
        &[],
    );
    assert_eq!(v["path"], "fallback");
    assert_eq!(v["mode"], "spatial");
    assert_eq!(v["format"], "nchw");
    assert_eq!(v["api"], "legacy");
    assert_eq!(codes(&v), ["not_nhwc", "not_persistent"]);
    assert_eq!((v["n"].as_i64(), v["h"].as_i64()), (Some(16), Some(12544)));
}

#[test]
fn two_d_under_oneflow_is_per_activation() {
    let v = json(
        &[
            "--shape",
            "65536,256",
            "--policy",
            "oneflow",
            "--fuse",
            "relu",
        ],
        &[],
    );
    assert_eq!(v["mode"], "per_activation");
    assert_eq!(v["policy"], "oneflow");
    assert_eq!(v["path"], "fallback");
    assert_eq!(codes(&v), ["not_persistent"]);
    // The default policy departs from OneFlow there.
    assert_eq!(
        json(&["--shape", "65536,256"], &[])["mode"],
        "spatial_persistent"
    );
}

#[test]
fn environment_sets_policy_and_nhwc_flags_override() {
    let two_d = ["--shape", "65536,256"];
    let env_fast = [("NNFUSE_BN_MODE_POLICY", "fast")];
    let env_oneflow = [("NNFUSE_BN_MODE_POLICY", "oneflow")];
    assert_eq!(json(&two_d, &env_oneflow)["mode"], "per_activation");
    let v = json(&two_d, &env_fast);
    assert_eq!(v["mode"], "spatial_persistent");
    assert_eq!(v["policy"], "fast");
    assert_eq!(v["sources"]["policy"], "NNFUSE_BN_MODE_POLICY");
    // The flag wins over the variable.
    let v = json(&["--shape", "65536,256", "--policy", "oneflow"], &env_fast);
    assert_eq!(v["mode"], "per_activation");
    assert_eq!(v["sources"]["policy"], "--policy");

    // OneFlow's NHWC flag turns channels-first training persistent.
    let cf = ["--shape", "16,32,112,112"];
    assert_eq!(json(&cf, &[])["mode"], "spatial");
    let v = json(&cf, &[("ONEFLOW_ENABLE_NHWC", "1")]);
    assert_eq!(v["mode"], "spatial_persistent");
    assert_eq!(v["enable_nhwc"], true);
    assert_eq!(v["sources"]["enable_nhwc"], "ONEFLOW_ENABLE_NHWC");
    assert_eq!(
        json(&cf, &[("NNFUSE_ENABLE_NHWC", "yes")])["mode"],
        "spatial_persistent"
    );
    let v = json(
        &["--shape", "16,32,112,112", "--nhwc", "false"],
        &[("ONEFLOW_ENABLE_NHWC", "1")],
    );
    assert_eq!(v["mode"], "spatial");
    assert_eq!(v["enable_nhwc"], false);

    // The fusion switch, from the variable and from the flag.
    let cl = [
        "--shape",
        "64,56,56,256",
        "--axis",
        "3",
        "--fuse",
        "relu",
        "--impl",
        "cudnn",
    ];
    assert_eq!(json(&cl, &[])["path"], "cudnn_fused");
    let v = json(
        &cl,
        &[
            ("NNFUSE_DISABLE_CUDNN_FUSION", "1"),
            ("NNFUSE_BN_IMPL", "cudnn"),
        ],
    );
    assert_eq!(v["path"], "fallback");
    assert_eq!(codes(&v), ["disabled_by_config"]);
    let mut flagged = cl.to_vec();
    flagged.push("--no-fusion");
    assert_eq!(codes(&json(&flagged, &[])), ["disabled_by_config"]);
}

#[test]
fn inference_and_old_cudnn() {
    let v = json(
        &[
            "--shape",
            "64,56,56,256",
            "--axis",
            "-1",
            "--fuse",
            "relu",
            "--inference",
        ],
        &[],
    );
    assert_eq!(v["phase"], "inference");
    assert_eq!(v["api"], "legacy");
    assert_eq!(v["mode"], "spatial");
    assert_eq!(codes(&v), ["inference", "not_persistent"]);
    // json() pins 91900; an old cuDNN (dotted form) is passed on its own.
    let out = nnfuse_plan(
        &[
            "--shape",
            "64,56,56,256",
            "--axis",
            "3",
            "--fuse",
            "relu",
            "--json",
            "--cudnn-version",
            "7.4.0",
        ],
        &[],
    );
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["cudnn_version"], 7400);
    assert_eq!(codes(&v), ["cudnn_too_old"]);
    assert_eq!(v["sources"]["cudnn_version"], "given");
}

#[test]
fn text_output_says_what_was_assumed() {
    let out = nnfuse_plan(
        &[
            "--shape",
            "16,32,112,112",
            "--dtype",
            "f16",
            "--fuse",
            "add-relu",
            "--cudnn-version",
            "91900",
            "--impl",
            "cudnn",
        ],
        &[],
    );
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "cuDNN 9.19.0 (91900), given by --cudnn-version",
        "mode   : CUDNN_BATCHNORM_SPATIAL",
        "path   : fallback",
        "not fused: cuDNN fuses BN+activation only for NHWC",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
    // Without --cudnn-version the version is the installed cuDNN's, or assumed (and said so).
    let out = nnfuse_plan(&["--shape", "16,32,112,112"], &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("assumed: no cuDNN found here") || text.contains("the installed cuDNN"),
        "{text}"
    );
}

#[test]
fn own_kernels_impl_variant_and_no_cudnn() {
    // Default (auto): channels-first training follows the table (OWN_FOR_CHANNELS_FIRST).
    let cf = [
        "--shape",
        "32,32,112,112",
        "--dtype",
        "f16",
        "--fuse",
        "relu",
    ];
    let v = json(&cf, &[]);
    if nnfuse::internals::batchnorm::OWN_FOR_CHANNELS_FIRST {
        assert_eq!((&v["path"], &v["impl"]), (&"own".into(), &"own".into()));
        // x (25.7 MB) fits the persistent budget forward; the plan follows
        // PREFER_PERSISTENT_CHANNELS_FIRST.
        let fwd = if nnfuse::internals::batchnorm::PREFER_PERSISTENT_CHANNELS_FIRST {
            "persistent"
        } else {
            "two_pass"
        };
        assert_eq!(v["own_forward"], fwd);
        assert_eq!(v["own_backward"], "two_pass");
    } else {
        assert_eq!(
            (&v["path"], &v["impl"]),
            (&"fallback".into(), &"cudnn".into())
        );
    }
    assert_eq!(v["sources"]["bn_impl"], "default");
    // The variable and the flag (the flag wins).
    let v = json(&cf, &[("NNFUSE_BN_IMPL", "cudnn")]);
    assert_eq!(
        (&v["path"], &v["impl"]),
        (&"fallback".into(), &"cudnn".into())
    );
    assert_eq!(v["sources"]["bn_impl"], "NNFUSE_BN_IMPL");
    let mut own = cf.to_vec();
    own.extend(["--impl", "own", "--own-variant", "two-pass"]);
    let v = json(&own, &[("NNFUSE_BN_IMPL", "cudnn")]);
    assert_eq!(v["path"], "own");
    assert_eq!(v["own_forward"], "two_pass");
    assert_eq!(v["sources"]["bn_impl"], "--impl");
    // Without cuDNN every plan is own, even channels-last training that cuDNN would fuse.
    let out = nnfuse_plan(
        &[
            "--shape",
            "64,56,56,256",
            "--axis",
            "3",
            "--fuse",
            "relu",
            "--no-cudnn",
            "--json",
        ],
        &[],
    );
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["path"], "own");
    assert_eq!(v["cudnn_available"], false);
    assert_eq!(v["sources"]["cudnn_version"], "none (--no-cudnn)");
    assert_eq!(codes(&v).last(), Some(&"cudnn_missing"));
    fails_naming(
        &nnfuse_plan(&["--shape", "2,3", "--impl", "vendor"], &[]),
        "--impl",
    );
    fails_naming(
        &nnfuse_plan(&["--shape", "2,3", "--own-variant", "fast"], &[]),
        "--own-variant",
    );
}

#[test]
fn bad_input_exits_2_naming_the_argument() {
    fails_naming(&nnfuse_plan(&["--shape", "2,0,3"], &[]), "shape[1]");
    fails_naming(&nnfuse_plan(&["--shape", "2,x3"], &[]), "shape[1]");
    fails_naming(&nnfuse_plan(&["--shape", ""], &[]), "shape");
    // A valid shape with one bad flag: the error names the flag's argument.
    for (flag, value, named) in [
        ("--axis", "2", "axis"),
        ("--axis", "-3", "axis"),
        ("--dtype", "f64", "dtype"),
        ("--fuse", "gelu", "fuse"),
        ("--policy", "quick", "--policy"),
        ("--nhwc", "maybe", "--nhwc"),
        ("--cudnn-version", "nine", "--cudnn-version"),
    ] {
        fails_naming(&nnfuse_plan(&["--shape", "2,3", flag, value], &[]), named);
    }
    fails_naming(&nnfuse_plan(&["--shape", "65536,65536"], &[]), "shape");
    for var in [
        "NNFUSE_BN_MODE_POLICY",
        "NNFUSE_ENABLE_NHWC",
        "ONEFLOW_ENABLE_NHWC",
        "NNFUSE_DISABLE_CUDNN_FUSION",
    ] {
        let out = nnfuse_plan(&["--shape", "2,3", "--json"], &[(var, "sometimes")]);
        fails_naming(&out, var);
    }
    // A missing --shape is clap's usage error, also exit 2.
    fails_naming(&nnfuse_plan(&[], &[]), "--shape");
}

/// Exit code 2 naming `what` and saying `why`.
fn fails_saying(out: &Output, what: &str, why: &str) {
    fails_naming(out, what);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(why), "stderr should say {why:?}: {stderr}");
}

#[test]
fn flags_of_the_convolution_plan_are_refused_not_ignored() {
    for flag in [
        &["--stride", "0"][..],
        &["--pad", "1"],
        &["--dilation", "2"],
        &["--format", "bogus"],
        &["--format", "nhwc"],
        &["--direction", "backward-data"],
        &["--winograd-gemm", "fused"],
        &["--deterministic", "true"],
        &["--workspace-mb", "64"],
        &["--cudnn", "absent"],
    ] {
        let args = [&["--shape", "2,3"][..], flag].concat();
        fails_saying(&nnfuse_plan(&args, &[]), flag[0], "convolution plan only");
    }
}

#[test]
fn contradictory_flags_exit_2_naming_both() {
    for (args, a, b) in [
        (
            &["--no-cudnn", "--cudnn", "present"][..],
            "--no-cudnn",
            "--cudnn",
        ),
        (
            &["--no-cudnn", "--cudnn-version", "91900"],
            "--no-cudnn",
            "--cudnn-version",
        ),
    ] {
        let args = [&["--shape", "2,3"][..], args].concat();
        let out = nnfuse_plan(&args, &[]);
        fails_naming(&out, a);
        fails_naming(&out, b);
    }
}

#[test]
fn cudnn_versions_that_name_no_release_are_refused() {
    for v in ["0", "0.0.0", "999", "12345", "1000000"] {
        let out = nnfuse_plan(&["--shape", "2,3", "--cudnn-version", v], &[]);
        fails_saying(&out, "--cudnn-version", "no cuDNN release");
    }
    let v = json(&["--shape", "2,3"], &[]);
    assert_eq!(v["cudnn_version"], 91900);
}

#[test]
fn errors_name_what_the_user_typed() {
    // The true element count, not a saturated one.
    let out = nnfuse_plan(&["--shape", "4294967296,4294967296,2"], &[]);
    fails_saying(&out, "--shape", "36893488147419103232 elements");
    // A negative number is a value that must be ≥ 0, not an unknown flag.
    fails_saying(
        &nnfuse_plan(&["--shape", "-1,3"], &[]),
        "shape[0]",
        "must be ≥ 0",
    );
    fails_saying(
        &nnfuse_plan(&["--shape", "2,-3"], &[]),
        "shape[1]",
        "must be ≥ 0",
    );
    // A negative axis still counts from the end.
    let v = json(&["--shape", "2,3", "--axis", "-1"], &[]);
    assert_eq!(v["axis"], 1);
}
