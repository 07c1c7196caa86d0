//! `nnfuse tune` as a user runs it: the problem is checked before any GPU is looked for (bad
//! input exits 2 naming the flag, on any machine), and no GPU is exit status 3.

mod common;

use common::nnfuse_binary as binary;
use std::process::{Command, Output};

fn tune(args: &[&str]) -> Output {
    let mut cmd = Command::new(binary());
    cmd.arg("tune").args(args);
    for var in nnfuse::config::ALL_VARS {
        cmd.env_remove(var);
    }
    cmd.output().expect("the nnfuse binary runs")
}

/// Exit status 2 and a message on stderr naming each of `what`.
fn fails_naming(args: &[&str], what: &[&str]) {
    let out = tune(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    for w in what {
        assert!(
            stderr.contains(w),
            "{args:?}: stderr should name {w}: {stderr}"
        );
    }
}

#[test]
fn a_bad_problem_is_reported_before_looking_for_a_gpu() {
    fails_naming(&["--gemm", "1,2,3"], &["--gemm"]);
    fails_naming(&["--gemm", "1,0,3,4"], &["--gemm", "empty"]);
    fails_naming(&["--gemm", "1,3000000000,3,4"], &["--gemm", "(m)"]);
    fails_naming(
        &["--gemm", "1,2,3,4", "--compute", "f16", "--dtype", "f32"],
        &["--compute"],
    );
    fails_naming(
        &[
            "--gemm",
            "1,2,3,4",
            "--compute",
            "f16",
            "--dtype",
            "f16",
            "--alpha",
            "1e6",
        ],
        &["--alpha"],
    );
    fails_naming(&["--gemm", "1,2,3,4", "--dtype", "f64"], &["--dtype"]);
}

#[test]
fn negative_numbers_must_be_non_negative() {
    fails_naming(&["--gemm", "-1,2,3,4"], &["--gemm", "must be ≥ 0"]);
    fails_naming(
        &["--gemm", "1,2,3,4", "--device", "-1"],
        &["--device", "must be ≥ 0"],
    );
}

#[test]
fn without_a_gpu_it_exits_3() {
    if nnfuse::context::driver_present() {
        return; // a GPU machine: the search runs (the GPU tests time it)
    }
    let out = tune(&["--gemm", "1,64,64,64", "--alpha", "-1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("libcuda"), "{stderr}");
}
