//! Fuzz the `nnfuse` command line as a user runs it: the built binary with argument vectors
//! drawn from its real flags (read from its own `--help`), arbitrary values, stray words, and
//! arbitrary NNFUSE_* environment values. The GPU is hidden (`CUDA_VISIBLE_DEVICES=`), so the
//! GPU subcommands answer "no GPU" at once on every machine.
//!
//! The property: the process exits by itself within the timeout with status 0, 2 or 3 (never a
//! signal, never "panicked"); every exit 2 says on stderr which flag, argument or variable is
//! wrong; a successful `--json` run prints exactly one JSON value. Bounded cases by default
//! (each starts a process); `PROPTEST_CASES=N` for long runs.

#[path = "common/mod.rs"]
mod common;
#[path = "fuzz_common/mod.rs"]
mod fuzz_common;

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use fuzz_common::{cases, BOUNDARIES};
use proptest::prelude::*;

const SUBCOMMANDS: [&str; 4] = ["plan", "tune", "demo", "info"];
/// Per process; a debug build plans in milliseconds, so this only catches hangs.
const TIMEOUT: Duration = Duration::from_secs(30);

/// The long flags `nnfuse <sub> --help` lists (so that the fuzzer follows the real CLI).
fn flags(sub: &str) -> &'static [String] {
    static ALL: OnceLock<Vec<(String, Vec<String>)>> = OnceLock::new();
    let all = ALL.get_or_init(|| {
        SUBCOMMANDS
            .iter()
            .map(|s| {
                let out = Command::new(common::nnfuse_binary())
                    .args([s, "--help"])
                    .output()
                    .expect("nnfuse runs");
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                let mut found: Vec<String> = text
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                    .filter(|w| w.starts_with("--") && w.len() > 2)
                    .map(String::from)
                    .collect();
                found.sort();
                found.dedup();
                assert!(
                    !found.is_empty() || *s == "info",
                    "no flags in `{s} --help`"
                );
                (s.to_string(), found)
            })
            .collect()
    });
    all.iter()
        .find(|(s, _)| s == sub)
        .map(|(_, f)| f.as_slice())
        .unwrap_or(&[])
}

/// Values a flag may get: the accepted words, shapes and numbers of every size and sign, and
/// arbitrary text.
fn value() -> impl Strategy<Value = String> {
    let words = prop::sample::select(vec![
        "",
        "0",
        "1",
        "-1",
        "-0",
        "2",
        "3",
        "4",
        "8",
        "-5",
        "1.5",
        "nan",
        "inf",
        "-inf",
        "1e40",
        "true",
        "false",
        "yes",
        "maybe",
        "f32",
        "f16",
        "bf16",
        "f64",
        "none",
        "relu",
        "add-relu",
        "oneflow",
        "auto",
        "fast",
        "cudnn",
        "own",
        "two-pass",
        "persistent",
        "im2col",
        "winograd",
        "winograd_f2x3",
        "winograd_f4x3",
        "direct",
        "seed",
        "tensor_core",
        "fused",
        "nchw",
        "nhwc",
        "forward",
        "backward-data",
        "backward-filter",
        "present",
        "absent",
        "91900",
        "9.19.0",
        "7.4.1",
        "16,32,112,112",
        "16x32x112x112",
        "2,3",
        "1",
        "0,0",
        "1,1",
        "3,3",
        "32,64,56,56,64,3,3",
        "1,1,1,1,1,1,1",
        "0,1,1,1,1,1,1",
        "1,2,3",
        ",",
        ",,",
        "x",
        "1x",
        "-1,2",
        "1,-2",
        "4294967296,1",
        "18446744073709551615,2",
        "2,18446744073709551616",
        "1,1,1",
        "8,16,16,16",
        "1,1,1,1",
        "0,8,8,8",
        "2674",
        "2675",
        "10000",
        "10001",
    ]);
    prop_oneof![
        5 => words.prop_map(String::from),
        2 => prop::sample::select(BOUNDARIES.to_vec()).prop_map(|v| v.to_string()),
        2 => prop::collection::vec(
            prop_oneof![prop::sample::select(BOUNDARIES.to_vec()), 0usize..70],
            1..9,
        )
        .prop_map(|v| v.iter().map(usize::to_string).collect::<Vec<_>>().join(",")),
        1 => any::<i64>().prop_map(|v| v.to_string()),
        1 => "[ -~]{0,24}",
        1 => any::<String>().prop_map(|s| s.replace('\0', "")),
    ]
}

/// One token: a real flag of the subcommand (or of another), `--flag=value`, a value, or a
/// stray word.
fn token(sub: &'static str) -> impl Strategy<Value = String> {
    let own = flags(sub).to_vec();
    let any_flag: Vec<String> = SUBCOMMANDS.iter().flat_map(|s| flags(s).to_vec()).collect();
    let own_or_help = if own.is_empty() {
        vec!["--help".to_string()]
    } else {
        own
    };
    prop_oneof![
        6 => prop::sample::select(own_or_help.clone()),
        2 => (prop::sample::select(own_or_help), value()).prop_map(|(f, v)| format!("{f}={v}")),
        4 => value(),
        1 => prop::sample::select(any_flag),
        1 => prop::sample::select(vec!["-h", "-V", "--version", "--", "-", "--nope", "plan", "info"])
            .prop_map(String::from),
    ]
}

/// A command line: a subcommand (or none, or a wrong one) and a few tokens, mostly flag-value
/// pairs.
fn argv() -> impl Strategy<Value = Vec<String>> {
    prop::sample::select(vec![
        "plan", "plan", "plan", "plan", "tune", "demo", "info", "", "x",
    ])
    .prop_flat_map(|sub| {
        let lookup = if sub.is_empty() || sub == "x" {
            "plan"
        } else {
            sub
        };
        let pairs =
            prop::collection::vec((token(lookup), prop::option::weighted(0.8, value())), 0..7);
        (Just(sub), pairs)
    })
    .prop_map(|(sub, pairs)| {
        let mut v = Vec::new();
        if !sub.is_empty() {
            v.push(sub.to_string());
        }
        for (t, val) in pairs {
            let is_flag = t.starts_with("--") && !t.contains('=');
            v.push(t);
            if let (true, Some(val)) = (is_flag, val) {
                v.push(val);
            }
        }
        v
    })
}

/// A list of `len` extents joined by `sep`: mostly small, at times a boundary.
fn extents(len: std::ops::Range<usize>, sep: &'static str) -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![8 => 1usize..40, 1 => 0usize..2, 1 => prop::sample::select(BOUNDARIES.to_vec())],
        len,
    )
    .prop_map(move |v| v.iter().map(usize::to_string).collect::<Vec<_>>().join(sep))
}

/// A plausible value for `flag` (nine times in ten), else any [`value`].
fn value_for(flag: &'static str) -> BoxedStrategy<String> {
    let words = |w: &[&'static str]| {
        prop::sample::select(w.to_vec())
            .prop_map(String::from)
            .boxed()
    };
    let good = match flag {
        "--shape" => prop_oneof![extents(1..7, ","), extents(1..7, "x")].boxed(),
        "--axis" => prop_oneof![
            (-7i64..7).prop_map(|v| v.to_string()),
            prop::sample::select(vec![i64::MIN, i64::MIN + 1, i64::MAX, -(1 << 32)])
                .prop_map(|v| v.to_string()),
        ]
        .boxed(),
        "--dtype" => words(&["f32", "f16", "bf16"]),
        "--fuse" => words(&["none", "relu", "add-relu"]),
        "--policy" => words(&[
            "oneflow",
            "auto",
            "fast",
            "cudnn",
            "im2col",
            "winograd",
            "winograd_f2x3",
            "winograd_f4x3",
            "direct",
        ]),
        "--nhwc" | "--deterministic" => words(&["true", "false"]),
        "--cudnn-version" => prop_oneof![
            words(&["91900", "7401", "7400", "9.19.0", "8.9.7", "0"]),
            any::<u64>().prop_map(|v| v.to_string()),
        ]
        .boxed(),
        "--impl" => words(&["auto", "cudnn", "own"]),
        "--own-variant" => words(&["auto", "two-pass", "persistent"]),
        "--conv" => prop_oneof![
            (extents(5..6, ","), 1usize..6, 1usize..6).prop_map(|(a, r, s)| format!("{a},{r},{s}")),
            extents(7..8, ","),
        ]
        .boxed(),
        "--stride" | "--dilation" => {
            prop_oneof![extents(1..3, ","), (1usize..4).prop_map(|v| v.to_string())].boxed()
        }
        "--pad" => prop_oneof![extents(1..3, ","), (0usize..4).prop_map(|v| v.to_string())].boxed(),
        "--format" => words(&["nchw", "nhwc"]),
        "--direction" => words(&["forward", "backward-data", "backward-filter"]),
        "--winograd-gemm" => words(&["auto", "seed", "tensor_core", "direct", "fused"]),
        "--workspace-mb" => prop_oneof![
            words(&["0", "1", "64", "256"]),
            prop::sample::select(BOUNDARIES.to_vec()).prop_map(|v| v.to_string()),
        ]
        .boxed(),
        "--cudnn" => words(&["present", "absent"]),
        "--gemm" => extents(4..5, ",").boxed(),
        "--compute" => words(&["f32", "f16"]),
        "--alpha" | "--beta" => words(&["0", "1", "-2.5", "70000", "nan", "inf"]),
        "--batch" | "--check-batch" | "--steps" | "--device" | "--seed" => prop_oneof![
            (0u64..40).prop_map(|v| v.to_string()),
            words(&["2674", "2675", "10001", "-1"])
        ]
        .boxed(),
        _ => value().boxed(),
    };
    prop_oneof![19 => good, 1 => value()].boxed()
}

/// Which flags go together: (subcommand, required flag, flags with a value, switches).
const FAMILIES: [(&str, &str, &[&str], &[&str]); 4] = [
    (
        "plan",
        "--shape",
        &[
            "--axis",
            "--dtype",
            "--fuse",
            "--policy",
            "--nhwc",
            "--cudnn-version",
            "--impl",
            "--own-variant",
        ],
        &["--inference", "--json", "--no-fusion", "--no-cudnn"],
    ),
    (
        "plan",
        "--conv",
        &[
            "--stride",
            "--pad",
            "--dilation",
            "--format",
            "--direction",
            "--winograd-gemm",
            "--deterministic",
            "--workspace-mb",
            "--cudnn",
            "--dtype",
            "--policy",
        ],
        &["--json"],
    ),
    (
        "tune",
        "--gemm",
        &["--dtype", "--compute", "--alpha", "--beta", "--device"],
        &["--trans-a", "--trans-b", "--own-buffers"],
    ),
    (
        "demo",
        "--batch",
        &[
            "--dtype",
            "--format",
            "--steps",
            "--check-batch",
            "--seed",
            "--device",
        ],
        &["--no-check", "--json", "--explain"],
    ),
];

/// `nnfuse plan` (BatchNorm or `--conv`), `tune` or `demo` with each flag at most once, only
/// flags that go together, and mostly plausible values: runs that get past the parser into the
/// planning code.
fn structured_argv() -> impl Strategy<Value = Vec<String>> {
    let family = |(sub, required, valued, switches): (
        &'static str,
        &'static str,
        &'static [&'static str],
        &'static [&'static str],
    )| {
        // The lists follow the real CLI: a renamed flag fails here, not silently.
        for f in std::iter::once(&required).chain(valued).chain(switches) {
            assert!(
                flags(sub).iter().any(|g| g == f),
                "`nnfuse {sub}` has no {f}"
            );
        }
        (
            value_for(required),
            prop::sample::subsequence(valued.to_vec(), 0..=valued.len().min(6)).prop_flat_map(
                |fs| {
                    fs.into_iter()
                        .map(|f| (Just(f), value_for(f)))
                        .collect::<Vec<_>>()
                },
            ),
            prop::sample::subsequence(switches.to_vec(), 0..=switches.len()),
        )
            .prop_map(move |(req, pairs, sw)| {
                let mut v = vec![sub.to_string(), required.to_string(), req];
                for (f, val) in pairs {
                    v.extend([f.to_string(), val]);
                }
                v.extend(sw.into_iter().map(String::from));
                v
            })
    };
    prop_oneof![
        4 => family(FAMILIES[0]),
        4 => family(FAMILIES[1]),
        1 => family(FAMILIES[2]),
        1 => family(FAMILIES[3]),
    ]
}

/// Some NNFUSE_* variables set to arbitrary values (three runs in four: none).
fn env() -> impl Strategy<Value = Vec<(&'static str, String)>> {
    let vars: Vec<&'static str> = nnfuse::config::ALL_VARS
        .into_iter()
        // A tuning-cache or kernel-cache path the fuzzer invents could name a real file.
        .filter(|k| {
            *k != nnfuse::config::ENV_TUNING_CACHE && *k != nnfuse::config::ENV_KERNEL_CACHE
        })
        .collect();
    prop::option::weighted(
        0.25,
        prop::collection::vec((prop::sample::select(vars), value()), 1..3),
    )
    .prop_map(Option::unwrap_or_default)
}

struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    took: Duration,
}

/// Runs the binary with `args` and `env`, the GPU hidden, killing it after [`TIMEOUT`].
fn run(args: &[String], env: &[(&str, String)]) -> Ran {
    // Output goes to files (no pipe to drain while waiting), read back through the handles
    // this process keeps: the names are removed at once, so nothing is left behind and nothing
    // else can touch them.
    static N: AtomicU64 = AtomicU64::new(0);
    let capture = |what: &str| {
        let path = std::env::temp_dir().join(format!(
            "nnfuse-fuzz-cli-{}-{}.{what}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .expect("a capture file");
        let _ = std::fs::remove_file(&path);
        f
    };
    let (mut out, mut err) = (capture("out"), capture("err"));
    let mut cmd = Command::new(common::nnfuse_binary());
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("dup"))
        .stderr(err.try_clone().expect("dup"))
        .env("CUDA_VISIBLE_DEVICES", "")
        .env_remove("NNFUSE_LOG")
        .env_remove("RUST_BACKTRACE");
    for var in nnfuse::config::ALL_VARS {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let t = Instant::now();
    let mut child = cmd.spawn().expect("the nnfuse binary starts");
    drop(cmd);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s);
        }
        if t.elapsed() > TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let took = t.elapsed();
    let read = |f: &mut std::fs::File| {
        use std::io::{Read, Seek, SeekFrom};
        let mut bytes = Vec::new();
        f.seek(SeekFrom::Start(0))
            .and_then(|_| f.read_to_end(&mut bytes))
            .expect("the capture file reads back");
        String::from_utf8_lossy(&bytes).into_owned()
    };
    let (stdout, stderr) = (read(&mut out), read(&mut err));
    Ran {
        code: status.and_then(|s| s.code()),
        stdout,
        stderr,
        took,
    }
}

fn check(args: &[String], env: &[(&str, String)]) -> Result<i32, TestCaseError> {
    let r = run(args, env);
    let ctx = format!(
        "nnfuse {args:?} env {env:?}: exit {:?} after {:?}\nstderr: {}\nstdout: {}",
        r.code, r.took, r.stderr, r.stdout
    );
    if std::env::var_os("NNFUSE_FUZZ_SHOW").is_some() {
        eprintln!("{ctx}");
    }
    prop_assert!(r.took < TIMEOUT, "hung: {ctx}");
    prop_assert!(r.code.is_some(), "killed by a signal: {ctx}");
    prop_assert!(!r.stderr.contains("panicked"), "panicked: {ctx}");
    let code = r.code.unwrap_or(-1);
    prop_assert!(matches!(code, 0 | 2 | 3), "exit status: {ctx}");
    if code == 2 {
        // Names a flag, a value or word given, a variable set, or a subcommand.
        let all_flags = SUBCOMMANDS.iter().flat_map(|s| flags(s).iter());
        let named = all_flags
            .map(|f| f.trim_start_matches('-'))
            .chain(args.iter().map(|a| a.trim()).filter(|a| !a.is_empty()))
            .chain(env.iter().map(|(k, _)| *k))
            .chain(SUBCOMMANDS)
            .any(|w| r.stderr.contains(w));
        prop_assert!(named, "exit 2 names nothing: {ctx}");
    }
    if code == 0
        && args.iter().any(|a| a == "--json")
        && !args.iter().any(|a| a == "--help" || a == "-h")
    {
        let v: Result<serde_json::Value, _> = serde_json::from_str(&r.stdout);
        prop_assert!(v.is_ok(), "--json printed no single JSON value: {ctx}");
    }
    Ok(code)
}

/// Exit statuses seen, for the summary line (0, 2, 3, other).
static SEEN: [AtomicU64; 4] = [
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
];

#[test]
fn cli_exits_cleanly_and_names_what_is_wrong() {
    let mut runner = proptest::test_runner::TestRunner::new(cases(200));
    let result = runner.run(
        &(prop_oneof![1 => argv(), 4 => structured_argv()], env()),
        |(args, env)| {
            let code = check(&args, &env)?;
            let slot = match code {
                0 => 0,
                2 => 1,
                3 => 2,
                _ => 3,
            };
            SEEN[slot].fetch_add(1, Ordering::Relaxed);
            Ok(())
        },
    );
    let n = |i: usize| SEEN[i].load(Ordering::Relaxed);
    // The summary docs/RELIABILITY.md quotes (`--nocapture` shows it).
    println!(
        "nnfuse CLI fuzz: {} runs: exit 0 {}, exit 2 {}, exit 3 {}, other {}",
        n(0) + n(1) + n(2) + n(3),
        n(0),
        n(1),
        n(2),
        n(3)
    );
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// From the command line, the planner's per-chunk allocation (tests/fuzz_plans.rs,
/// `conv_plan_huge_batch_allocates_per_chunk`) aborted the process: "memory allocation of
/// 140737488355328 bytes failed", SIGABRT. Fixed: the chunks are counted, not listed.
#[test]
fn cli_plan_conv_huge_batch_aborts() {
    let args = [
        "plan",
        "--conv",
        "4611686018427387903,1,1,1,1,1,1",
        "--stride",
        "2",
        "--workspace-mb",
        "1",
        "--cudnn",
        "absent",
    ]
    .map(String::from)
    .to_vec();
    let r = run(&args, &[]);
    assert!(
        matches!(r.code, Some(0 | 2)) && !r.stderr.contains("memory allocation"),
        "exit {:?}: {}",
        r.code,
        r.stderr
    );
}
