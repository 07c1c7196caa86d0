//! What the fuzz targets (`tests/fuzz_*.rs`) share: the case budget and the integer
//! strategies that reach every boundary.
#![allow(dead_code)]

use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;

/// `default` cases (what CI runs), or `PROPTEST_CASES` when set (the long runs recorded in
/// docs/RELIABILITY.md). No regression files are written: a failure prints its minimal input,
/// which is then kept as a named test.
pub fn cases(default: u32) -> ProptestConfig {
    let n = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases: n,
        failure_persistence: None,
        max_shrink_iters: 4096,
        ..ProptestConfig::default()
    }
}

/// The integers where arithmetic breaks: 0, 1, powers of two around `i32`, `u32`, `i64` and
/// `usize` limits, and their neighbours.
pub const BOUNDARIES: [usize; 18] = [
    0,
    1,
    2,
    3,
    (1 << 16) - 1,
    1 << 16,
    i32::MAX as usize,
    1 << 31,
    u32::MAX as usize,
    1 << 32,
    (1 << 32) + 1,
    1 << 40,
    i64::MAX as usize,
    1 << 63,
    usize::MAX / 2,
    usize::MAX - 1,
    usize::MAX,
    usize::MAX / 3,
];

/// Any extent: mostly small, often a boundary, sometimes anything.
pub fn dim() -> impl Strategy<Value = usize> + Clone {
    prop_oneof![
        4 => 0usize..=4,
        3 => 1usize..=300,
        2 => prop::sample::select(BOUNDARIES.to_vec()),
        1 => any::<usize>(),
    ]
}

/// An extent that is usually small enough for a plan to come out, with the same edges as
/// [`dim`] one time in ten.
pub fn small_dim() -> impl Strategy<Value = usize> + Clone {
    prop_oneof![
        6 => 1usize..=8,
        2 => 0usize..=64,
        1 => prop::sample::select(BOUNDARIES.to_vec()),
        1 => any::<usize>(),
    ]
}

/// What one case came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A result (a plan, a value, a loaded entry) that passed every check.
    Value,
    /// A typed error that named what is wrong.
    Rejected,
}

/// Runs `body` over `strategy` for [`cases`]`(default)` cases, then prints one line (shown
/// with `--nocapture`) with how many cases gave a value or a typed error, and
/// fails with the minimal failing input if any case failed.
pub fn check_all<S>(
    name: &str,
    default: u32,
    strategy: S,
    body: impl Fn(S::Value) -> Result<Outcome, TestCaseError>,
) where
    S: Strategy,
    S::Value: std::fmt::Debug,
{
    use std::cell::Cell;
    let counts = [Cell::new(0u64), Cell::new(0u64)];
    let started = std::time::Instant::now();
    let mut runner = proptest::test_runner::TestRunner::new(cases(default));
    let result = runner.run(&strategy, |v| {
        let o = body(v)?;
        let i = match o {
            Outcome::Value => 0,
            Outcome::Rejected => 1,
        };
        counts[i].set(counts[i].get() + 1);
        Ok(())
    });
    let [v, r] = counts.map(|c| c.get());
    println!(
        "{name}: {} cases in {:.1} s: {v} values, {r} typed errors",
        v + r,
        started.elapsed().as_secs_f64()
    );
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
}

/// Runs the test `name` again in a child process (this executable, that one test) so that an
/// abort (a failed allocation) is reported instead of ending every test here: `None` in the
/// child (run the body), the child's output in the parent.
pub fn in_child(name: &str) -> Option<std::process::Output> {
    const CHILD: &str = "NNFUSE_FUZZ_CHILD";
    if std::env::var(CHILD).is_ok_and(|v| v == name) {
        return None;
    }
    let exe = std::env::current_exe().expect("the test executable's path");
    Some(
        std::process::Command::new(exe)
            .args([name, "--exact", "--include-ignored", "--nocapture"])
            .env(CHILD, name)
            .output()
            .expect("the test executable runs"),
    )
}
