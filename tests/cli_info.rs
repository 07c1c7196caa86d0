//! `nnfuse info` as a user runs it: one line per missing piece and exit status 3 on a machine
//! without a GPU; 2 for an invalid configuration. Needs no GPU.

mod common;

use common::run_nnfuse;
use std::process::Output;

fn info(env: &[(&str, &str)]) -> Output {
    run_nnfuse(&["info"], &[], env)
}

#[test]
fn without_a_driver_it_exits_3_with_one_line_per_missing_piece() {
    if nnfuse::context::driver_present() {
        return; // a GPU machine: nothing missing to report here
    }
    let out = info(&[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{stdout}");
    let driver_lines = stdout.lines().filter(|l| l.contains("libcuda.so")).count();
    assert_eq!(
        driver_lines, 1,
        "the driver is one missing piece:\n{stdout}"
    );
    let device = stdout
        .lines()
        .find(|l| l.starts_with("device"))
        .expect("a device line");
    assert!(!device.contains("MISSING"), "{device}");
    assert!(!stdout.contains("panicked"));
}

#[test]
fn an_invalid_configuration_exits_2_naming_the_variable() {
    let out = info(&[("NNFUSE_BN_IMPL", "sometimes")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{stdout}");
    assert!(stdout.contains("NNFUSE_BN_IMPL"), "{stdout}");
    // Where errors go, too (on a GPU machine nothing else is printed there).
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("invalid configuration") && stderr.contains("NNFUSE_BN_IMPL"),
        "{stderr}"
    );
}
