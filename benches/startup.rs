//! First-call cost in a fresh process (issue 11: the first GEMM call of a process took 934 ms on
//! the H100): `Context::new`, then the first `gemm::strided_batched` of a 16 x 1024³ f16 problem,
//! each scenario in fresh child processes (this executable, re-run with `NNFUSE_STARTUP_CHILD`),
//! median of a few runs:
//!
//! - `cold`: empty kernel disk cache and tuning file (the first run ever): NVRTC compiles the
//!   search's kernels, the search runs, both caches are written.
//! - `warm-kernels`: the kernel images come from the disk cache, no tuning file: the search
//!   still runs, NVRTC does not.
//! - `warm-both`: kernel images and the tuning file from disk: no compile, no search (the
//!   file's choice is checked with `cublasLtMatmulAlgoCheck` before its first use).
//! - `no-search`: `gemm_search` off: the cuBLAS default, the floor of library start-up.
//!
//! For `cold` and `warm-kernels` a second kind of child runs `gemm::search_on` instead (the same
//! path as the first call) to report where the time goes: one-off setup (NVRTC or disk read of
//! the search kernels, module load, cuBLAS/cuBLASLt handles, workspace, cuBLASLt's first
//! heuristic query) and the search's phases. The floor printed beside each row is the GEMM's
//! own time (the second call, measured in the same child); the target is a warm first call of at
//! most 300 ms. Prints a table, then JSON lines.
//!
//! Then the **first call of a new convolution problem** (issue 20's target: forward, data and
//! filter gradient together ≤ 300 ms at the 95th percentile over `benches/conv_problems.txt`,
//! never over 1 s, the process's first convolution included): one fresh child process with an
//! empty kernel disk cache and an empty tuning file (default budget,
//! `NNFUSE_CONV_TUNE_BUDGET_MS` as set) runs every problem in turn — `Conv2d::new`, `forward`,
//! `backward_data`, `backward_filter`, synchronised — and reports each problem's wall time; the
//! table gives the median, 95th percentile and maximum, and the process's first convolution
//! apart (it also pays cuDNN's and cuBLAS's start-up). Candidates whose kernels NVRTC has not
//! compiled yet are skipped and compiled in the background (docs/CONV.md); the table counts the
//! directions that skipped some, and the end says how many compiles were still pending. The demo's
//! cold first step is `nnfuse demo`'s own line.
//!
//! `cargo bench --bench startup` (on a GPU; about 30 s). `NNFUSE_STARTUP_RUNS=n` sets the runs
//! per scenario (default 3).

#[path = "support/conv_problems.rs"]
mod conv_problems;
#[path = "support/exit.rs"]
mod exit;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use half::f16;
use nnfuse::gemm::{self, Problem};
use nnfuse::internals::kernels;
use nnfuse::{Config, Context};
use serde::{Deserialize, Serialize};

const CHILD_ENV: &str = "NNFUSE_STARTUP_CHILD";
const MARK: &str = "NNFUSE_STARTUP_JSON ";
const SHAPE: (usize, usize, usize, usize) = (16, 1024, 1024, 1024);
const TARGET_MS: f64 = 300.0;
/// The first call of a new convolution problem (three directions): p95 and maximum targets.
const CONV_P95_TARGET_MS: f64 = 300.0;
const CONV_MAX_TARGET_MS: f64 = 1000.0;

/// What a child does.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Spec {
    scenario: String,
    /// `call`: the first `strided_batched`; `search`: the first `search_on`.
    kind: String,
    kernel_cache: Option<PathBuf>,
    tuning_cache: Option<PathBuf>,
    gemm_search: bool,
}

/// What a child measured (ms).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Measured {
    scenario: String,
    kind: String,
    context_ms: f64,
    first_ms: f64,
    second_ms: f64,
    nvrtc_compiled: u64,
    nvrtc_compile_ms: f64,
    disk_hits: u64,
    disk_read_ms: f64,
    /// `search` children only.
    setup_ms: f64,
    setup_first_query_ms: f64,
    search_wall_ms: f64,
    prepare_ms: f64,
    candidates_ms: f64,
    alloc_ms: f64,
    check_ms: f64,
    timing_ms: f64,
    /// Spawn to exit, seen by the parent.
    process_ms: f64,
    /// `conv` children: each problem's name and first-call wall time (three directions, ms),
    /// in the file's order (the first is the process's first convolution).
    #[serde(default)]
    conv: Vec<(String, f64)>,
    /// `conv` children: per problem, the directions whose first call skipped candidates whose
    /// kernels were not compiled yet (they compile in the background).
    #[serde(default)]
    conv_skipped: Vec<usize>,
    /// `conv` children: per problem, the three directions' measurements' own wall time (the
    /// reports' `wall_ms`, ms): the rest of the first call is planning, cuDNN plan building,
    /// handles and compiles.
    #[serde(default)]
    conv_measuring: Vec<f64>,
    /// `conv` children: background compiles still running or queued after the last problem.
    #[serde(default)]
    background_pending: usize,
    /// `conv` children: the decisions' reports (every direction) of the problems whose first
    /// call took longer than the p95 target: where their time went, candidate by candidate.
    #[serde(default)]
    conv_slow_reports: Vec<String>,
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Deterministic values in [-1, 1) of type `T`, uploaded.
fn uploaded<T: nnfuse::Element + cudarc::driver::DeviceRepr>(
    ctx: &Context,
    len: usize,
    seed: u64,
) -> nnfuse::Result<cudarc::driver::CudaSlice<T>> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let host: Vec<T> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            T::from_f64((x >> 40) as f64 / (1u64 << 24) as f64 * 2.0 - 1.0)
        })
        .collect();
    ctx.stream()
        .clone_htod(&host)
        .map_err(|e| nnfuse::Error::Driver {
            call: "startup bench upload",
            status: format!("{e:?}"),
        })
}

/// One problem's first call: plan, forward, data gradient, filter gradient, synchronised (ms),
/// and how many directions skipped candidates whose kernels were not compiled yet.
fn conv_first_call<T: nnfuse::Element + cudarc::driver::DeviceRepr>(
    ctx: &Context,
    s: &nnfuse::conv::ConvShape,
) -> nnfuse::Result<(f64, usize, f64, String)> {
    let x = uploaded::<T>(ctx, s.x_len()?, 1)?;
    let w = uploaded::<T>(ctx, s.w_len()?, 2)?;
    let dy = uploaded::<T>(ctx, s.y_len()?, 3)?;
    let (mut y, mut dx, mut dw) = (
        uploaded::<T>(ctx, s.y_len()?, 4)?,
        uploaded::<T>(ctx, s.x_len()?, 5)?,
        uploaded::<T>(ctx, s.w_len()?, 6)?,
    );
    ctx.synchronize()?;
    let t = Instant::now();
    let conv = nnfuse::conv::Conv2d::<T>::new(ctx, s)?;
    conv.forward(&x, &w, &mut y)?;
    conv.backward_data(&dy, &w, &mut dx)?;
    conv.backward_filter(&x, &dy, &mut dw, false)?;
    ctx.synchronize()?;
    let t = ms(t);
    let skipped = nnfuse::conv::Direction::ALL
        .into_iter()
        .filter(|&d| {
            conv.choice(d).is_some_and(|c| {
                c.notes
                    .iter()
                    .any(|n| n.contains("kernels not compiled yet"))
            })
        })
        .count();
    let measuring: f64 = nnfuse::conv::Direction::ALL
        .into_iter()
        .filter_map(|d| conv.report(d).map(|r| r.wall_ms))
        .sum();
    let reports = if t > CONV_P95_TARGET_MS {
        nnfuse::conv::Direction::ALL
            .into_iter()
            .filter_map(|d| conv.report(d).map(|r| r.to_string()))
            .collect::<Vec<_>>()
            .join("")
    } else {
        String::new()
    };
    Ok((t, skipped, measuring, reports))
}

/// The `conv` child: every problem's first call in one fresh Context (caches as `spec` says).
fn conv_child(spec: &Spec) -> nnfuse::Result<Measured> {
    let config = Config::from_env()?
        .with_kernel_cache(spec.kernel_cache.clone())
        .with_tuning_cache(spec.tuning_cache.clone());
    let t = Instant::now();
    let ctx = Context::with_config(0, config)?;
    let mut out = Measured {
        scenario: spec.scenario.clone(),
        kind: spec.kind.clone(),
        context_ms: ms(t),
        ..Measured::default()
    };
    let problems = conv_problems::parse(include_str!("conv_problems.txt"))
        .map_err(|e| nnfuse::Error::invalid("conv_problems.txt", e))?;
    for p in &problems {
        let (t, skipped, measuring, reports) = match p.dtype.as_str() {
            "f16" => conv_first_call::<f16>(&ctx, &p.shape)?,
            "bf16" => conv_first_call::<half::bf16>(&ctx, &p.shape)?,
            _ => conv_first_call::<f32>(&ctx, &p.shape)?,
        };
        out.conv.push((format!("{} {}", p.name, p.dtype), t));
        out.conv_skipped.push(skipped);
        out.conv_measuring.push(measuring);
        if !reports.is_empty() {
            out.conv_slow_reports
                .push(format!("{} {} ({t:.1} ms):\n{reports}", p.name, p.dtype));
        }
    }
    out.background_pending = kernels::background_compiles();
    let k = kernels::stats();
    out.nvrtc_compiled = k.compiled;
    out.nvrtc_compile_ms = k.compile_ms;
    Ok(out)
}

fn child(spec: &Spec) -> nnfuse::Result<Measured> {
    if spec.kind == "conv" {
        return conv_child(spec);
    }
    let config = Config::default()
        .with_kernel_cache(spec.kernel_cache.clone())
        .with_tuning_cache(spec.tuning_cache.clone())
        .with_gemm_search(spec.gemm_search);
    let t = Instant::now();
    let ctx = Context::with_config(0, config)?;
    let context_ms = ms(t);
    let (batch, m, n, k) = SHAPE;
    let p = Problem::packed(batch, m, n, k);
    // Operands from the host (no nnfuse kernel may run before the measured call).
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut rand = |len: usize| -> Vec<f16> {
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                f16::from_f32((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
            })
            .collect()
    };
    let s = ctx.stream();
    let err = |e: cudarc::driver::DriverError| nnfuse::Error::Driver {
        call: "startup bench allocation",
        status: format!("{e:?}"),
    };
    let a = s.clone_htod(&rand(batch * m * k)).map_err(err)?;
    let b = s.clone_htod(&rand(batch * k * n)).map_err(err)?;
    let mut c = s.alloc_zeros::<f16>(batch * m * n).map_err(err)?;
    ctx.synchronize()?;

    let mut out = Measured {
        scenario: spec.scenario.clone(),
        kind: spec.kind.clone(),
        context_ms,
        ..Measured::default()
    };
    let t = Instant::now();
    if spec.kind == "search" {
        let r = gemm::search_on(&ctx, &p, &a, &b, &mut c)?;
        ctx.synchronize()?;
        out.first_ms = ms(t);
        out.setup_ms = r.setup_ms;
        out.setup_first_query_ms = r.setup_first_query_ms;
        out.search_wall_ms = r.wall_ms;
        out.prepare_ms = r.phases.prepare_ms;
        out.candidates_ms = r.phases.candidates_ms;
        out.alloc_ms = r.phases.alloc_ms;
        out.check_ms = r.phases.check_ms;
        out.timing_ms = r.phases.timing_ms;
    } else {
        gemm::strided_batched(&ctx, &p, &a, &b, &mut c)?;
        ctx.synchronize()?;
        out.first_ms = ms(t);
    }
    let t = Instant::now();
    gemm::strided_batched(&ctx, &p, &a, &b, &mut c)?;
    ctx.synchronize()?;
    out.second_ms = ms(t);
    let k = kernels::stats();
    out.nvrtc_compiled = k.compiled;
    out.nvrtc_compile_ms = k.compile_ms;
    out.disk_hits = k.disk_hits;
    out.disk_read_ms = k.disk_read_ms;
    Ok(out)
}

fn spawn(spec: &Spec) -> Result<Measured, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let json = serde_json::to_string(spec).map_err(|e| e.to_string())?;
    let t = Instant::now();
    let out = Command::new(exe)
        .env(CHILD_ENV, json)
        .output()
        .map_err(|e| format!("spawn: {e}"))?;
    let process_ms = ms(t);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(MARK))
        .ok_or_else(|| {
            format!(
                "child {} / {} exited {:?} without a result:\n{stdout}\n{}",
                spec.scenario,
                spec.kind,
                out.status.code(),
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
    let mut m: Measured = serde_json::from_str(line).map_err(|e| e.to_string())?;
    m.process_ms = process_ms;
    Ok(m)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

/// Medians of every field over the runs of one scenario and kind.
fn summarise(runs: &[Measured]) -> Measured {
    let med = |f: fn(&Measured) -> f64| median(runs.iter().map(f).collect());
    let first = runs.first().cloned().unwrap_or_default();
    Measured {
        context_ms: med(|m| m.context_ms),
        first_ms: med(|m| m.first_ms),
        second_ms: med(|m| m.second_ms),
        nvrtc_compile_ms: med(|m| m.nvrtc_compile_ms),
        disk_read_ms: med(|m| m.disk_read_ms),
        setup_ms: med(|m| m.setup_ms),
        setup_first_query_ms: med(|m| m.setup_first_query_ms),
        search_wall_ms: med(|m| m.search_wall_ms),
        prepare_ms: med(|m| m.prepare_ms),
        candidates_ms: med(|m| m.candidates_ms),
        alloc_ms: med(|m| m.alloc_ms),
        check_ms: med(|m| m.check_ms),
        timing_ms: med(|m| m.timing_ms),
        process_ms: med(|m| m.process_ms),
        ..first
    }
}

fn fresh(root: &Path, name: &str) -> PathBuf {
    let d = root.join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn parent() -> Result<(), String> {
    let runs: usize = std::env::var("NNFUSE_STARTUP_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1);
    let root = std::env::temp_dir().join(format!("nnfuse-startup-{}", std::process::id()));
    std::fs::create_dir_all(&root).map_err(|e| e.to_string())?;
    let spec = |scenario: &str, kind: &str, k: Option<&Path>, t: Option<&Path>, search| Spec {
        scenario: scenario.into(),
        kind: kind.into(),
        kernel_cache: k.map(Path::to_path_buf),
        tuning_cache: t.map(Path::to_path_buf),
        gemm_search: search,
    };
    let mut all: Vec<Measured> = Vec::new();
    for r in 0..runs {
        // The first run ever: both caches empty; it fills them.
        let kdir = fresh(&root, &format!("kernels-{r}"));
        let tfile = root.join(format!("tuning-{r}.json"));
        let _ = std::fs::remove_file(&tfile);
        all.push(spawn(&spec(
            "cold",
            "call",
            Some(&kdir),
            Some(&tfile),
            true,
        ))?);
        all.push(spawn(&spec(
            "warm-kernels",
            "call",
            Some(&kdir),
            None,
            true,
        ))?);
        all.push(spawn(&spec(
            "warm-both",
            "call",
            Some(&kdir),
            Some(&tfile),
            true,
        ))?);
        all.push(spawn(&spec("no-search", "call", None, None, false))?);
        // Where the time goes (search_on takes the first call's path).
        let kdir2 = fresh(&root, &format!("kernels-search-{r}"));
        all.push(spawn(&spec("cold", "search", Some(&kdir2), None, true))?);
        all.push(spawn(&spec(
            "warm-kernels",
            "search",
            Some(&kdir2),
            None,
            true,
        ))?);
        eprintln!("startup bench: run {} of {runs} done", r + 1);
    }
    let kdir = fresh(&root, "kernels-conv");
    let tfile = root.join("tuning-conv.json");
    let _ = std::fs::remove_file(&tfile);
    let conv = spawn(&spec("cold", "conv", Some(&kdir), Some(&tfile), true))?;
    let _ = std::fs::remove_dir_all(&root);

    let (batch, m, n, k) = SHAPE;
    println!(
        "\n## First GEMM call in a fresh process ({batch} x {m}x{n}x{k} f16, median of {runs} \
         runs; ms)\n"
    );
    println!(
        "| scenario | Context::new | first call | NVRTC compile | kernel disk read | floor: \
         the GEMM (2nd call) | first / floor | vs cold | process | target ≤ {TARGET_MS:.0} |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    let pick = |sc: &str, kind: &str| -> Vec<Measured> {
        all.iter()
            .filter(|x| x.scenario == sc && x.kind == kind)
            .cloned()
            .collect()
    };
    let cold = summarise(&pick("cold", "call"));
    let mut summaries = Vec::new();
    for sc in ["cold", "warm-kernels", "warm-both", "no-search"] {
        let s = summarise(&pick(sc, "call"));
        println!(
            "| {sc} | {:.1} | {:.1} | {:.1} ({} files) | {:.2} ({} files) | {:.3} | {:.0}x | \
             {:.2} | {:.0} | {} |",
            s.context_ms,
            s.first_ms,
            s.nvrtc_compile_ms,
            s.nvrtc_compiled,
            s.disk_read_ms,
            s.disk_hits,
            s.second_ms,
            s.first_ms / s.second_ms,
            s.first_ms / cold.first_ms,
            s.process_ms,
            if s.first_ms <= TARGET_MS {
                "met"
            } else {
                "missed"
            }
        );
        summaries.push(s);
    }
    println!("\n### Where the first call's time goes (`gemm::search_on`, same path)\n");
    println!(
        "| scenario | total | setup | of which NVRTC | of which disk read | of which 1st \
         heuristic query | search | prepare | candidates | alloc | check | timing |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for sc in ["cold", "warm-kernels"] {
        let s = summarise(&pick(sc, "search"));
        println!(
            "| {sc} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | \
             {:.1} | {:.1} |",
            s.first_ms,
            s.setup_ms,
            s.nvrtc_compile_ms,
            s.disk_read_ms,
            s.setup_first_query_ms,
            s.search_wall_ms,
            s.prepare_ms,
            s.candidates_ms,
            s.alloc_ms,
            s.check_ms,
            s.timing_ms
        );
        summaries.push(s);
    }
    println!(
        "\nsetup = search kernels (NVRTC or disk) + module load + cuBLAS/cuBLASLt handles + \
         workspace + first heuristic query; the rest of `total` is the search itself and the \
         tuned call."
    );
    print_conv(&conv);
    println!();
    let rows = summaries
        .iter()
        .map(|s| (s, "median"))
        .chain(all.iter().map(|s| (s, "run")));
    for (s, row) in rows {
        let mut v = serde_json::to_value(s).map_err(|e| e.to_string())?;
        v["bench"] = "startup".into();
        v["row"] = row.into();
        v["target_ms"] = TARGET_MS.into();
        println!("{v}");
    }
    Ok(())
}

/// The convolution table: every problem's first call, then median, p95 and maximum (the
/// process's first convolution apart) against the targets.
fn print_conv(m: &Measured) {
    println!(
        "\n## First call of a new convolution problem (forward + data + filter gradient, fresh \
         Context, empty kernel cache and tuning file; ms)\n"
    );
    println!(
        "| problem | first call | of which measuring (check + timing) | the rest (plans, cuDNN \
         plan building, handles, compiles) | directions that skipped uncompiled candidates \
         |\n|---|---:|---:|---:|---:|"
    );
    for (i, (name, t)) in m.conv.iter().enumerate() {
        let skipped = m.conv_skipped.get(i).copied().unwrap_or(0);
        let measuring = m.conv_measuring.get(i).copied().unwrap_or(f64::NAN);
        println!(
            "| {name} | {t:.1} | {measuring:.1} | {:.1} | {skipped} |",
            t - measuring
        );
    }
    let rest: Vec<f64> = m.conv.iter().skip(1).map(|c| c.1).collect();
    let mut all: Vec<f64> = m.conv.iter().map(|c| c.1).collect();
    all.sort_by(f64::total_cmp);
    let q = |p: f64| {
        all.get(((all.len().max(1) - 1) as f64 * p).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    let max = all.last().copied().unwrap_or(f64::NAN);
    let first = m.conv.first().map_or(f64::NAN, |c| c.1);
    let verdict = |ok: bool| if ok { "met" } else { "missed" };
    println!(
        "\n| over {} problems | median | p95 (target ≤ {CONV_P95_TARGET_MS:.0}) | max (target ≤ \
         {CONV_MAX_TARGET_MS:.0}) | process's first convolution | max of the others |",
        all.len()
    );
    println!("|---|---:|---:|---:|---:|---:|");
    println!(
        "| ms | {:.1} | {:.1} ({}) | {max:.1} ({}) | {first:.1} | {:.1} |",
        q(0.5),
        q(0.95),
        verdict(q(0.95) <= CONV_P95_TARGET_MS),
        verdict(max <= CONV_MAX_TARGET_MS),
        rest.iter().copied().fold(f64::NAN, f64::max),
    );
    println!(
        "\nContext::new {:.1} ms; NVRTC compiled {} files in {:.0} ms over the whole run (in \
         the background where a first call did not wait: candidates whose kernels were not \
         compiled yet were skipped); {} background compiles still pending at the end.",
        m.context_ms, m.nvrtc_compiled, m.nvrtc_compile_ms, m.background_pending
    );
    if !m.conv_slow_reports.is_empty() {
        println!(
            "\n### First calls over {CONV_P95_TARGET_MS:.0} ms: the decisions' reports\n\n```"
        );
        for r in &m.conv_slow_reports {
            println!("{r}");
        }
        println!("```");
    }
}

fn main() -> ExitCode {
    if let Ok(json) = std::env::var(CHILD_ENV) {
        let spec: Spec = match serde_json::from_str(&json) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("bad {CHILD_ENV}: {e}");
                return ExitCode::FAILURE;
            }
        };
        return match child(&spec) {
            Ok(m) => match serde_json::to_string(&m) {
                Ok(line) => {
                    println!("{MARK}{line}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("{e}");
                    ExitCode::FAILURE
                }
            },
            Err(e) => {
                eprintln!("startup child {} / {}: {e}", spec.scenario, spec.kind);
                ExitCode::FAILURE
            }
        };
    }
    if !nnfuse::context::driver_present() {
        let why =
            nnfuse::Error::NoDevice("no CUDA driver on this machine; nothing measured".into());
        return exit::finish("startup", Err(why.into()));
    }
    exit::finish("startup", parent().map_err(anyhow::Error::msg))
}
