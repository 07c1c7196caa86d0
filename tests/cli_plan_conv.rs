//! `nnfuse plan --conv` as a user runs it: the built binary, its JSON, its help, its exit codes
//! and the environment variables it shares with the library. Needs no GPU.

mod common;

use common::{exits_2_naming as fails_naming, nnfuse_binary as binary, plan_json, run_nnfuse};
use std::process::{Command, Output};

use serde_json::Value;

/// Runs `nnfuse plan ARGS` with nnfuse's variables cleared, then `env` set.
fn nnfuse_plan(args: &[&str], env: &[(&str, &str)]) -> Output {
    let cleared = ["NNFUSE_LOG", nnfuse::conv::ENV_CONV_CUDNN_SEARCH];
    run_nnfuse(&[&["plan"], args].concat(), &cleared, env)
}

/// Runs with `--json --cudnn present` and parses stdout as exactly one JSON object.
fn json(args: &[&str], env: &[(&str, &str)]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    if !args.contains(&"--cudnn") {
        all.extend(["--cudnn", "present"]);
    }
    plan_json(&all, &nnfuse_plan(&all, env))
}

fn labels(v: &Value) -> Vec<String> {
    v["candidates"]
        .as_array()
        .expect("candidates is a list")
        .iter()
        .map(|c| c.as_str().expect("labels are strings").to_string())
        .collect()
}

const RESNET: &[&str] = &[
    "--conv",
    "32,64,56,56,64,3,3",
    "--pad",
    "1,1",
    "--format",
    "nhwc",
    "--dtype",
    "f16",
];

#[test]
fn the_issue_example_plans_auto_with_every_candidate() {
    let v = json(RESNET, &[]);
    assert_eq!(v["path"], "cudnn");
    assert_eq!(v["measured"], true);
    assert_eq!(v["direction"], "forward");
    assert_eq!(v["dtype"], "f16");
    assert_eq!(v["format"], "nhwc");
    assert_eq!(v["out_hw"], serde_json::json!([56, 56]));
    assert_eq!(
        labels(&v),
        [
            "cudnn",
            "im2col_gemm",
            "winograd_f4x3/tensor_core",
            "winograd_f4x3/direct",
            "winograd_f4x3/fused",
            "winograd_f2x3/tensor_core",
            "winograd_f2x3/direct",
            "winograd_f2x3/fused"
        ]
    );
    assert_eq!(v["sources"]["policy"], "default");
    assert_eq!(v["sources"]["cudnn_present"], "--cudnn");
    assert_eq!(v["cudnn_search"], "heuristic");
    assert_eq!(
        v["paths"][3]["winograd"]["seed_rule"],
        serde_json::json!([16, 16, 16])
    );
    // Text output says the same.
    let out = nnfuse_plan(&[RESNET, &["--cudnn", "present"]].concat(), &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        text.contains("measured at the first call among 8 candidates"),
        "{text}"
    );
    assert!(
        text.contains("seed rule (16,16,16) -> tensor_core, fused engine: yes"),
        "{text}"
    );
}

#[test]
fn flags_and_environment_steer_the_plan() {
    // Without cuDNN the first own candidate leads.
    let v = json(&[RESNET, &["--cudnn", "absent"]].concat(), &[]);
    assert_eq!(v["path"], "im2col_gemm");
    assert_eq!(v["cudnn_present"], false);
    // The policy from the environment, then from the flag.
    let v = json(RESNET, &[("NNFUSE_CONV_ALGO", "winograd_f2x3")]);
    assert_eq!(v["path"], "winograd_f2x3");
    assert_eq!(v["sources"]["policy"], "NNFUSE_CONV_ALGO");
    let v = json(
        &[RESNET, &["--policy", "im2col"]].concat(),
        &[("NNFUSE_CONV_ALGO", "winograd_f2x3")],
    );
    assert_eq!(
        (v["path"].as_str(), v["measured"].as_bool()),
        (Some("im2col_gemm"), Some(false))
    );
    assert_eq!(v["sources"]["policy"], "--policy");
    // Engine policy and the seed's rule: C = 30 fails it.
    let v = json(
        &[
            "--conv",
            "3,30,14,14,64,3,3",
            "--pad",
            "1",
            "--format",
            "nhwc",
            "--dtype",
            "f16",
            "--policy",
            "winograd_f4x3",
            "--winograd-gemm",
            "seed",
        ],
        &[],
    );
    assert_eq!(v["engine"], "direct");
    assert_eq!(v["paths"][3]["winograd"]["decided_by"], "seed_rule");
    // Directions.
    let v = json(&[RESNET, &["--direction", "backward-filter"]].concat(), &[]);
    assert_eq!(labels(&v), ["cudnn", "im2col_gemm"]);
    let v = json(
        &[
            RESNET,
            &["--direction", "backward-data", "--deterministic", "true"],
        ]
        .concat(),
        &[],
    );
    assert_eq!(v["deterministic"], true);
    assert!(labels(&v).iter().any(|l| l.starts_with("winograd_f4x3")));
    // Workspace cap from the flag.
    let v = json(&[RESNET, &["--workspace-mb", "1"]].concat(), &[]);
    assert_eq!(v["workspace_cap_bytes"], 1 << 20);
    assert_eq!(v["paths"][1]["eligible"], false);
    // 7x7 stride 2 pad 3 NCHW: no Winograd.
    let v = json(
        &[
            "--conv",
            "32,3,224,224,64,7,7",
            "--stride",
            "2",
            "--pad",
            "3",
        ],
        &[],
    );
    assert_eq!(v["out_hw"], serde_json::json!([112, 112]));
    assert_eq!(labels(&v), ["cudnn", "im2col_gemm"]);
}

#[test]
fn help_documents_the_convolution_flags() {
    let out = Command::new(binary())
        .args(["plan", "--help"])
        .output()
        .expect("runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    for flag in [
        "--conv <N,C,H,W,K,R,S>",
        "--stride",
        "--pad",
        "--dilation",
        "--format",
        "--direction",
        "--winograd-gemm",
        "--deterministic",
        "--workspace-mb",
        "--cudnn <present|absent>",
        "winograd_f4x3",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}:\n{text}");
    }
}

#[test]
fn bad_input_exits_2_naming_it() {
    let base = ["--conv", "1,3,5,5,8,3,3"];
    for (extra, what) in [
        (&["--format", "chwn"][..], "--format"),
        (&["--policy", "fft"][..], "--policy"),
        (&["--direction", "sideways"][..], "--direction"),
        (&["--winograd-gemm", "wgmma"][..], "--winograd-gemm"),
        (&["--stride", "1,2,3"][..], "--stride"),
        (&["--pad=-1"][..], "--pad"),
        (&["--deterministic", "maybe"][..], "--deterministic"),
        (&["--workspace-mb", "0"][..], "--workspace-mb"),
        (&["--cudnn", "sometimes"][..], "--cudnn"),
        (&["--dtype", "f64"][..], "dtype"),
        (&["--stride", "0"][..], "stride"),
        (&["--dilation", "0,1"][..], "dilation"),
    ] {
        let out = nnfuse_plan(&[&base[..], extra].concat(), &[]);
        fails_naming(&out, what);
    }
    fails_naming(&nnfuse_plan(&["--conv", "1,3,5"], &[]), "--conv");
    fails_naming(&nnfuse_plan(&["--conv", "1,3,5,5,q,3,3"], &[]), "--conv[4]");
    // A filter larger than the padded input names kh; a zero dim names it.
    fails_naming(&nnfuse_plan(&["--conv", "1,3,2,9,8,5,1"], &[]), "kh");
    fails_naming(&nnfuse_plan(&["--conv", "1,0,5,5,8,3,3"], &[]), "c_in");
    // A bad environment value names the variable.
    fails_naming(
        &nnfuse_plan(&base, &[("NNFUSE_CONV_ALGO", "fft")]),
        "NNFUSE_CONV_ALGO",
    );
    // BatchNorm-only flags conflict with --conv (clap's usage error, also exit 2).
    let out = nnfuse_plan(&["--conv", "1,3,5,5,8,3,3", "--shape", "1,2"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--shape"));
}

#[test]
fn batchnorm_plans_still_work_beside_conv() {
    let out = nnfuse_plan(
        &[
            "--shape",
            "8,32,14,14",
            "--json",
            "--cudnn-version",
            "91900",
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v.get("mode").is_some());
    // Neither --shape nor --conv: a usage error.
    assert_eq!(nnfuse_plan(&[], &[]).status.code(), Some(2));
}

#[test]
fn flags_of_the_batchnorm_plan_are_refused_not_ignored() {
    let base = ["--conv", "1,3,5,5,8,3,3"];
    for flag in [
        &["--axis", "7"][..],
        &["--impl", "bogus"],
        &["--impl", "own"],
        &["--own-variant", "two-pass"],
        &["--no-cudnn"],
        &["--shape", "2,3"],
        &["--fuse", "relu"],
        &["--inference"],
        &["--no-fusion"],
        &["--cudnn-version", "91900"],
    ] {
        let out = nnfuse_plan(&[&base[..], flag].concat(), &[]);
        fails_naming(&out, flag[0]);
        fails_naming(&out, "--conv");
    }
}

#[test]
fn negative_numbers_must_be_non_negative() {
    for (args, what) in [
        (&["--conv", "-1,3,5,5,8,3,3"][..], "--conv[0] (n)"),
        (&["--conv", "1,3,5,5,8,3,3", "--stride", "-1"], "--stride"),
        (&["--conv", "1,3,5,5,8,3,3", "--pad", "1,-1"], "--pad"),
    ] {
        let out = nnfuse_plan(args, &[]);
        fails_naming(&out, what);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("must be ≥ 0"), "{args:?}: {stderr}");
    }
    let out = nnfuse_plan(&["--conv", "1,3,5,5,8,3,3", "--workspace-mb", "-5"], &[]);
    fails_naming(&out, "--workspace-mb");
}

/// A plan that no path can run is printed (it says why), and the exit status is 2 with stderr
/// naming why: a script must not take "NOT RUNNABLE" for a plan.
#[test]
fn a_plan_that_nothing_runs_exits_2_naming_why() {
    let args = ["--conv", "1,3,8,8,4,3,3", "--pad", "1000000", "--cudnn"];
    for present in ["present", "absent"] {
        let out = nnfuse_plan(&[&args[..], &[present]].concat(), &[]);
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert_eq!(out.status.code(), Some(2), "{present}: {stdout}{stderr}");
        assert!(stdout.contains("NOT RUNNABLE"), "{stdout}");
        assert!(stdout.contains("direct         not eligible"), "{stdout}");
        assert!(stderr.contains("NOT RUNNABLE"), "{stderr}");
        assert!(stderr.contains("32-bit per-image indices"), "{stderr}");
        let json = nnfuse_plan(&[&args[..], &[present, "--json"]].concat(), &[]);
        assert_eq!(json.status.code(), Some(2));
        let v: Value = serde_json::from_slice(&json.stdout).expect("one JSON object");
        assert_eq!(v["runnable"], false);
    }
    // The same problem with pad 1 runs: exit 0.
    let out = nnfuse_plan(&["--conv", "1,3,8,8,4,3,3", "--pad", "1"], &[]);
    assert_eq!(out.status.code(), Some(0));
}

/// `NNFUSE_CONV_CUDNN_SEARCH` is read with the other variables: `find` shows in the JSON, an
/// unknown value exits 2 naming the variable (it once was a warning, then `heuristic`).
#[test]
fn the_cudnn_search_variable_is_checked_like_the_others() {
    let var = nnfuse::conv::ENV_CONV_CUDNN_SEARCH;
    let v = json(&["--conv", "1,3,8,8,4,3,3"], &[(var, "find")]);
    assert_eq!(v["cudnn_search"], "find");
    let out = nnfuse_plan(&["--conv", "1,3,8,8,4,3,3"], &[(var, "maybe")]);
    fails_naming(&out, var);
}
