//! What `nnfuse demo` found, and how it is printed: text tables for people, one JSON object for
//! machines. Pure: no GPU (the GPU half fills these structures).

use nnfuse::internals::timing::{Paired, Timing};
use nnfuse::Config;
use serde_json::{json, Value};

use super::bits::BitRow;
use super::block::{direction_index, step_floor_us, step_flops, BlockDef, Op, STEP};
use super::check::Row;
use super::host_profile::HostProfile;
use super::plans::{bn_line, conv_line, unit_line, BlockPlans};
use super::variants::Variant;

/// The exit status of a demo run, as documented in `docs/DEMO.md`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// The check passed (or was skipped) and the steps were timed: 0.
    Ok,
    /// An output exceeded its tolerance: 1 (nothing timed).
    CheckFailed,
    /// `--graph`: the replay's outputs differ from an eager step's: 1 (replays not timed).
    GraphDiffers,
    /// `--graph`: the step could not be captured into a CUDA graph (the driver's error is
    /// printed): 4.
    NotCapturable,
    /// No GPU, or a CUDA library missing: the plans were printed: 3.
    NoGpu,
}

impl Status {
    /// The process exit code.
    pub const fn code(self) -> u8 {
        match self {
            Status::Ok => 0,
            Status::CheckFailed | Status::GraphDiffers => 1,
            Status::NoGpu => 3,
            Status::NotCapturable => 4,
        }
    }

    /// `ok`, `check_failed`, `graph_differs`, `no_gpu`, `not_capturable`.
    pub const fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::CheckFailed => "check_failed",
            Status::GraphDiffers => "graph_differs",
            Status::NoGpu => "no_gpu",
            Status::NotCapturable => "not_capturable",
        }
    }
}

/// What one timed step measured.
#[derive(Debug, Clone, PartialEq)]
pub struct StepTimes {
    /// GPU time of each operation of [`STEP`] (ms, between consecutive events).
    pub ops_ms: Vec<f64>,
    /// GPU time of the whole step (ms, first to last event).
    pub total_ms: f64,
    /// Host time to queue the step (ms).
    pub host_ms: f64,
    /// GPU time of the same step queued again with only two events, around it (ms): what the
    /// step takes without the events between its operations. `None` when not measured.
    pub bare_ms: Option<f64>,
}

/// What ran for one operation, once the first step decided.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The operation.
    pub op: Op,
    /// The route or path, short (`cudnn:IMPLICIT_PRECOMP_GEMM/tensor_op`, `cudnn_fused/...`).
    pub route: String,
    /// How it was decided, and what else there is to know.
    pub detail: String,
}

/// One variant's run on the GPU.
#[derive(Debug, Clone)]
pub struct VariantRun {
    /// The variant.
    pub variant: Variant,
    /// Wall time of its first step (every first-call cost included), ms.
    pub first_step_ms: f64,
    /// Of which: the convolutions' `auto` measurements made by this run, ms.
    pub conv_measure_ms: f64,
    /// What each operation ran.
    pub decisions: Vec<Decision>,
    /// The timed steps (empty when nothing was timed).
    pub times: Vec<StepTimes>,
    /// Wall-clock time per step (ms) of each loop of steps queued back to back, one
    /// synchronize at its end (loop `k` of every variant ran back to back).
    pub loop_ms: Vec<f64>,
    /// Host time (ms) to queue one step right after a synchronize, one per sample.
    pub host_step_ms: Vec<f64>,
    /// Host time (ms) to queue one step while the GPU is busy (behind a head start), one per
    /// sample: what a loop that keeps the GPU busy pays.
    pub host_busy_ms: Vec<f64>,
    /// Of those samples, how many the GPU finished its head start before the step was queued
    /// (after the head start was doubled twice): a call may have waited for the GPU.
    pub host_busy_idle: usize,
}

/// `--graph`: nnfuse's step captured into a CUDA graph and replayed.
#[derive(Debug, Clone, Default)]
pub struct GraphReport {
    /// Why the step could not be captured (the failing call's and the driver's errors).
    pub not_capturable: Option<String>,
    /// Wall time of the capture, instantiation and upload (ms).
    pub capture_ms: f64,
    /// The captured step's kernel launches and other nodes (`None` when not read).
    pub nodes: Option<(usize, usize)>,
    /// Every output of the replay against an eager step (empty when not captured).
    pub rows: Vec<BitRow>,
    /// Wall-clock time per replay (ms) of each loop of replays (one synchronize per loop).
    pub loop_ms: Vec<f64>,
    /// Host time (ms) of one replay queued on an idle GPU, one per sample.
    pub host_ms: Vec<f64>,
    /// GPU time (ms) of one replay behind a head start, one per sample.
    pub gpu_ms: Vec<f64>,
}

impl GraphReport {
    /// Captured, and every output matched (see [`BitRow::ok`]).
    pub fn passed(&self) -> bool {
        self.not_capturable.is_none() && !self.rows.is_empty() && self.rows.iter().all(BitRow::ok)
    }
}

/// The correctness check.
#[derive(Debug, Clone)]
pub struct CheckReport {
    /// Its batch.
    pub batch: usize,
    /// Per variant: the block's step at `batch`, then the classifier at the timed batch.
    pub rows: Vec<(Variant, Vec<Row>)>,
    /// Remarks (a route that could not be forced, ...).
    pub notes: Vec<String>,
}

impl CheckReport {
    /// Whether every comparison passed.
    pub fn passed(&self) -> bool {
        self.rows.iter().all(|(_, r)| r.iter().all(Row::ok))
    }

    /// Comparisons made.
    pub fn count(&self) -> usize {
        self.rows.iter().map(|(_, r)| r.len()).sum()
    }
}

/// Everything a run found.
#[derive(Debug, Clone)]
pub struct Report {
    /// The block at the timed batch.
    pub def: BlockDef,
    /// The check's batch (None with `--no-check`).
    pub check_batch: Option<usize>,
    /// Timed steps asked for.
    pub steps: usize,
    /// Seed of the random inputs.
    pub seed: u64,
    /// The user's configuration (nnfuse's variant).
    pub config: Config,
    /// Device and libraries, one line each (`device 0: ...`, `cuDNN 9.19.0`).
    pub environment: Vec<String>,
    /// The plans of every variant.
    pub plans: Vec<BlockPlans>,
    /// What the plans assume about cuDNN (found or not, which version).
    pub plan_basis: String,
    /// Why the GPU part could not run (no-GPU mode).
    pub missing: Option<String>,
    /// The variants' runs.
    pub runs: Vec<VariantRun>,
    /// The check.
    pub check: Option<CheckReport>,
    /// Fills of the head start and the GPU time of one (ms).
    pub head_start: Option<(usize, f64)>,
    /// `--graph`'s result (None without `--graph`, or when nothing was timed).
    pub graph: Option<GraphReport>,
    /// `--profile-host`'s breakdown of nnfuse's host time (None without it, or when nothing
    /// was timed).
    pub host_profile: Option<HostProfile>,
    /// The outcome.
    pub status: Status,
}

/// A text table: columns padded to their widest cell, `right[i]` right-aligns column `i`.
pub fn table(header: &[&str], rows: &[Vec<String>], right: &[bool]) -> String {
    let cols = header.len();
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate().take(cols) {
            width[i] = width[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| -> String {
        let mut s = String::from(" ");
        for (i, c) in cells.iter().enumerate() {
            let pad = width[i].saturating_sub(c.chars().count());
            let last = i + 1 == cells.len();
            if right.get(i).copied().unwrap_or(false) {
                s.push_str(&" ".repeat(pad));
                s.push_str(c);
            } else {
                s.push_str(c);
                if !last {
                    s.push_str(&" ".repeat(pad));
                }
            }
            if !last {
                s.push_str("  ");
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(header.to_vec());
    for r in rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

fn us(ms: f64) -> String {
    if ms.is_finite() {
        format!("{:.1}", ms * 1e3)
    } else {
        "-".into()
    }
}

fn sci(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else {
        format!("{v:.1e}")
    }
}

/// Median (and p10, p90) of operation `k`'s GPU time over the steps; `None` without steps.
pub fn op_timing(times: &[StepTimes], k: usize) -> Option<Timing> {
    Timing::from_samples(
        times
            .iter()
            .filter_map(|t| t.ops_ms.get(k).copied())
            .collect(),
    )
}

/// Which time of a step: [`whole_step`] or [`two_event_step`].
type StepPick = fn(&StepTimes) -> Option<f64>;

/// The whole step, first to last event.
fn whole_step(t: &StepTimes) -> Option<f64> {
    Some(t.total_ms)
}

/// The step queued again with only two events around it (`None` when not measured).
fn two_event_step(t: &StepTimes) -> Option<f64> {
    t.bare_ms
}

/// The same for the whole step.
pub fn step_timing(times: &[StepTimes]) -> Option<Timing> {
    picked_timing(times, whole_step)
}

/// The same for the whole step without events between its operations (`None` without samples).
pub fn bare_step_timing(times: &[StepTimes]) -> Option<Timing> {
    picked_timing(times, two_event_step)
}

fn picked_timing(times: &[StepTimes], pick: StepPick) -> Option<Timing> {
    Timing::from_samples(times.iter().filter_map(pick).collect())
}

/// The same for the host's queueing time.
pub fn host_timing(times: &[StepTimes]) -> Option<Timing> {
    Timing::from_samples(times.iter().map(|t| t.host_ms).collect())
}

/// The same for the loops' wall-clock time per step.
pub fn loop_timing(r: &VariantRun) -> Option<Timing> {
    Timing::from_samples(r.loop_ms.clone())
}

/// The host's time to queue one step on an idle GPU; without those samples, the host time
/// measured while queueing the timed steps (between their events).
pub fn host_step_timing(r: &VariantRun) -> Option<Timing> {
    Timing::from_samples(r.host_step_ms.clone()).or_else(|| host_timing(&r.times))
}

/// The host's time to queue one step while the GPU is busy; `None` without samples.
pub fn host_busy_timing(r: &VariantRun) -> Option<Timing> {
    Timing::from_samples(r.host_busy_ms.clone())
}

/// The host time of the headline: while the GPU is busy (what a loop that keeps the GPU busy
/// pays), else right after a synchronize.
pub fn headline_host_timing(r: &VariantRun) -> Option<Timing> {
    host_busy_timing(r).or_else(|| host_step_timing(r))
}

/// `other`'s loop time over `nnfuse`'s, loop by loop (loops of one index ran back to back).
pub fn loop_speedup(nnfuse: &VariantRun, other: &VariantRun) -> Option<Paired> {
    Paired::of(&nnfuse.loop_ms, &other.loop_ms)
}

/// Milliseconds for a headline: two decimals, three below 0.1 ms.
fn ms(v: f64) -> String {
    if v < 0.1 {
        format!("{v:.3}")
    } else {
        format!("{v:.2}")
    }
}

/// `other`'s step time over `nnfuse`'s, step by step (steps of one index ran back to back):
/// above 1, nnfuse is faster.
pub fn speedup(nnfuse: &[StepTimes], other: &[StepTimes]) -> Option<Paired> {
    picked_speedup(nnfuse, other, whole_step)
}

/// [`speedup`] of the step time `pick` chooses.
fn picked_speedup(nnfuse: &[StepTimes], other: &[StepTimes], pick: StepPick) -> Option<Paired> {
    let a: Vec<f64> = nnfuse.iter().filter_map(pick).collect();
    let b: Vec<f64> = other.iter().filter_map(pick).collect();
    Paired::of(&a, &b)
}

impl Report {
    fn run(&self, v: Variant) -> Option<&VariantRun> {
        self.runs.iter().find(|r| r.variant == v)
    }

    fn plans(&self, v: Variant) -> Option<&BlockPlans> {
        self.plans.iter().find(|p| p.variant == v)
    }

    /// The block in one line.
    fn block_line(&self) -> String {
        let d = &self.def;
        format!(
            "ResNet-50 bottleneck (identity shortcut) at {hw}x{hw}: 1x1 conv {c}->{m}, BN+ReLU, \
             3x3 conv {m}->{m} pad 1, BN+ReLU, 1x1 conv {m}->{c}, BN + block input, ReLU; plus \
             ResNet-50's classifier GEMM fc {fi}->{fo} (forward and both gradients, on its own \
             random features: not connected to the block)",
            hw = d.hw,
            c = d.c,
            m = d.mid,
            fi = d.fc_in,
            fo = d.fc_out
        )
    }

    fn run_line(&self) -> String {
        format!(
            "batch {}{}, {}, {}, {} timed steps, seed {}",
            self.def.n,
            match self.check_batch {
                Some(b) => format!(" (check at batch {b})"),
                None => " (no check)".into(),
            },
            self.def.dtype,
            self.def.format.name().to_ascii_uppercase(),
            self.steps,
            self.seed
        )
    }

    fn config_line(&self) -> String {
        let c = &self.config;
        format!(
            "config (nnfuse): conv {}, winograd_gemm {}, deterministic {}, conv workspace {} MiB, \
             BN mode policy {}, NHWC flag {}, cuDNN fusion {}, GEMM search {}",
            c.conv_algo,
            c.winograd_gemm,
            c.deterministic,
            c.conv_workspace_mb,
            c.bn_mode_policy,
            if c.enable_nhwc { "on" } else { "off" },
            if c.disable_cudnn_fusion {
                "disabled"
            } else {
                "allowed"
            },
            if c.gemm_search { "on" } else { "off" }
        )
    }

    /// The plans section (text).
    pub fn plans_text(&self, explain: bool) -> String {
        let mut s = String::new();
        let Some(p) = self.plans(Variant::Nnfuse) else {
            return s;
        };
        s.push_str(&format!(
            "plans (nnfuse, before the first call; no GPU needed; {}):\n",
            self.plan_basis
        ));
        let mut rows = Vec::new();
        for op in STEP {
            let line = if let Some((i, d)) = op.conv() {
                let k = direction_index(d);
                conv_line(&p.convs[i][k])
            } else if let Some(i) = op.bn() {
                if matches!(op, Op::BnBwd(_)) {
                    continue;
                }
                bn_line(&p.bns[i])
            } else if op.is_fc() {
                if p.config.gemm_search {
                    "cuBLASLt candidates searched at the first call (NNFUSE_GEMM_SEARCH on)".into()
                } else {
                    "cuBLAS default (NNFUSE_GEMM_SEARCH off)".into()
                }
            } else {
                "nnfuse's add kernel (y += x)".into()
            };
            let name = match op {
                Op::BnFwd(i) => format!("bn{} (fwd+bwd)", i + 1),
                _ => op.name(),
            };
            rows.push(vec![name, op.describe(&self.def), line]);
        }
        s.push_str(&table(&["op", "what", "plan"], &rows, &[]));
        for (i, u) in p.units.iter().enumerate() {
            s.push_str(&format!(
                "unit conv{n}+bn{n} (block::ConvBnTrain): {}\n",
                unit_line(u),
                n = i + 1
            ));
        }
        for v in [Variant::CudnnSpatial, Variant::CudnnPersistent] {
            if let Some(b) = self.plans(v) {
                s.push_str(&format!(
                    "baseline {}: {}\n  BatchNorm plans: {}\n",
                    v.title(),
                    v.describe(),
                    bn_line(&b.bns[0])
                ));
            }
        }
        if explain {
            for pl in &self.plans {
                s.push_str(&format!("\nfull plans of {}:\n", pl.variant.title()));
                for (i, c) in pl.convs.iter().enumerate() {
                    for plan in c {
                        s.push_str(&format!("[conv{}] {plan}", i + 1));
                    }
                }
                for (i, b) in pl.bns.iter().enumerate() {
                    s.push_str(&format!("[bn{}] {b}\n", i + 1));
                }
                for (i, u) in pl.units.iter().enumerate() {
                    s.push_str(&format!("[unit{}] {u}", i + 1));
                }
            }
        }
        s
    }

    /// The header (block, run, environment, configuration) and the plans: what is known
    /// before the GPU runs anything.
    pub fn head_text(&self, explain: bool) -> String {
        let mut s = String::new();
        s.push_str("nnfuse demo: a ResNet-50 bottleneck block's training step\n");
        s.push_str(&format!("block: {}\n", self.block_line()));
        s.push_str(&format!("run: {}\n", self.run_line()));
        for e in &self.environment {
            s.push_str(&format!("{e}\n"));
        }
        s.push_str(&self.config_line());
        s.push_str("\n\n");
        s.push_str(&self.plans_text(explain));
        s
    }

    /// What the GPU run found: first-step costs, decisions, check, timing.
    pub fn results_text(&self) -> String {
        let mut s = self.first_step_text();
        s.push_str(&self.decisions_text());
        if let Some(c) = &self.check {
            s.push_str(&check_text(c));
        }
        if self.status == Status::CheckFailed {
            s.push_str("nothing was timed: the check failed (exit status 1)\n");
        }
        s.push_str(&self.timing_text());
        if let Some(p) = &self.host_profile {
            let busy = self.run(Variant::Nnfuse).and_then(host_busy_timing);
            s.push_str(&p.to_text(busy.map(|t| t.median_ms)));
        }
        if let Some(g) = &self.graph {
            s.push_str(&self.graph_text(g));
        }
        let head = self.headline();
        if !head.is_empty() {
            s.push('\n');
            for line in head {
                s.push_str(&line);
                s.push('\n');
            }
        }
        s
    }

    /// The summary a reader looks for: what a training loop runs at with nnfuse (host and GPU
    /// time beside it) against each baseline's loop, and with `--graph` the replay's. Empty
    /// when nothing was timed.
    pub fn headline(&self) -> Vec<String> {
        let mut lines = Vec::new();
        let Some(nn) = self.run(Variant::Nnfuse) else {
            return lines;
        };
        let Some(lp) = loop_timing(nn) else {
            return lines;
        };
        let mut gpu = step_timing(&nn.times).map_or("-".into(), |t| ms(t.median_ms));
        if let Some(t) = bare_step_timing(&nn.times) {
            gpu.push_str(&format!(
                " ms; {} ms without per-operation events",
                ms(t.median_ms)
            ));
        } else {
            gpu.push_str(" ms");
        }
        let mut line = format!(
            "nnfuse step: loop {} ms (host {} ms, GPU {gpu})",
            ms(lp.median_ms),
            headline_host_timing(nn).map_or("-".into(), |t| ms(t.median_ms)),
        );
        let others: Vec<String> = self
            .runs
            .iter()
            .filter(|r| r.variant != Variant::Nnfuse)
            .filter_map(|r| {
                let t = loop_timing(r)?;
                let p = loop_speedup(nn, r)?;
                Some(format!(
                    "{} loop {} ms: {:.2}x",
                    r.variant.title(),
                    ms(t.median_ms),
                    p.median
                ))
            })
            .collect();
        if !others.is_empty() {
            line.push_str(" — ");
            line.push_str(&others.join(", "));
        }
        lines.push(line);
        if let Some(g) = &self.graph {
            if let Some(t) = Timing::from_samples(g.loop_ms.clone()) {
                lines.push(format!(
                    "nnfuse graph: replay loop {} ms (host {} ms, GPU {} ms), {}",
                    ms(t.median_ms),
                    Timing::from_samples(g.host_ms.clone()).map_or("-".into(), |t| ms(t.median_ms)),
                    Timing::from_samples(g.gpu_ms.clone()).map_or("-".into(), |t| ms(t.median_ms)),
                    graph_match(g)
                ));
            }
        }
        lines
    }

    /// The table's `step` row of the step time `pick` chooses: each variant's median, with the
    /// baselines' per-step ratio to nnfuse.
    fn step_row(&self, nn: &VariantRun, what: &str, pick: StepPick) -> Vec<String> {
        let mut row = vec![
            "step".to_string(),
            what.to_string(),
            us(step_floor_us(&self.def) * 1e-3),
        ];
        for r in &self.runs {
            let mut cell = us(picked_timing(&r.times, pick).map_or(f64::NAN, |t| t.median_ms));
            if r.variant != Variant::Nnfuse {
                if let Some(p) = picked_speedup(&nn.times, &r.times, pick) {
                    cell.push_str(&format!(" ({:.2}x)", p.median));
                }
            }
            row.push(cell);
        }
        row
    }

    fn graph_text(&self, g: &GraphReport) -> String {
        if let Some(why) = &g.not_capturable {
            return format!(
                "\ngraph (--graph): nnfuse's step could not be captured into a CUDA graph \
                 ({:.1} ms): {why} (exit status 4)\n",
                g.capture_ms
            );
        }
        let nodes = g.nodes.map_or(String::new(), |(k, o)| {
            format!("; {k} kernel launches and {o} other nodes")
        });
        let mut s = format!(
            "\ngraph (--graph): nnfuse's whole step captured into one CUDA graph ({:.1} ms to \
             capture, instantiate and upload{nodes}); a replay against eager steps on the same inputs \
             and running statistics, every output poisoned first, raw bits of {} outputs:\n",
            g.capture_ms,
            g.rows.len()
        );
        let loose: Vec<&BitRow> = g.rows.iter().filter(|r| r.eager_differs > 0).collect();
        if !loose.is_empty() {
            let rows: Vec<Vec<String>> = loose
                .iter()
                .map(|r| {
                    vec![
                        r.label(),
                        format!("{}/{}", r.eager_differs, r.elements),
                        format!("{}/{}", r.graph_differs, r.elements),
                        r.compared.as_ref().map_or("-".into(), |c| sci(c.rel_l2)),
                        sci(r.tol),
                    ]
                })
                .collect();
            s.push_str(
                " outputs two eager steps do not reproduce bit for bit (held to the tolerance):
",
            );
            s.push_str(&table(
                &[
                    "output",
                    "eager vs eager differ",
                    "graph vs eager differ",
                    "rel L2",
                    "tolerance",
                ],
                &rows,
                &[false, true, true, true, true],
            ));
        }
        let failed: Vec<String> = g
            .rows
            .iter()
            .filter(|r| !r.ok())
            .map(|r| {
                format!(
                    "{}: {} of {} elements differ (first at {}){}",
                    r.label(),
                    r.graph_differs,
                    r.elements,
                    r.first_differing.map_or("-".into(), |i| i.to_string()),
                    r.compared.as_ref().map_or(String::new(), |c| format!(
                        ", relative L2 {}",
                        sci(c.rel_l2)
                    ))
                )
            })
            .collect();
        if failed.is_empty() {
            s.push_str(&format!("graph check PASSED: {}\n", graph_match(g)));
        } else {
            s.push_str(&format!(
                "graph check FAILED ({} of {} outputs differ from eager; replays not timed, exit \
                 status 1):\n",
                failed.len(),
                g.rows.len()
            ));
            for f in failed {
                s.push_str(&format!("  {f}\n"));
            }
        }
        if let Some(t) = Timing::from_samples(g.loop_ms.clone()) {
            let eager = self.run(Variant::Nnfuse);
            s.push_str(&format!(
                "graph replay: loop {} ms per step (median of {} loops of {} replays, p10 {}, \
                 p90 {}), host {} ms per replay (queued on an idle GPU), GPU {} ms per replay \
                 (CUDA events behind a head start); eager nnfuse: loop {} ms, GPU {} ms\n",
                ms(t.median_ms),
                t.iters,
                self.steps,
                ms(t.p10_ms),
                ms(t.p90_ms),
                Timing::from_samples(g.host_ms.clone()).map_or("-".into(), |t| ms(t.median_ms)),
                Timing::from_samples(g.gpu_ms.clone()).map_or("-".into(), |t| ms(t.median_ms)),
                eager
                    .and_then(loop_timing)
                    .map_or("-".into(), |t| ms(t.median_ms)),
                eager
                    .and_then(|r| step_timing(&r.times))
                    .map_or("-".into(), |t| ms(t.median_ms)),
            ));
        }
        s
    }

    /// The whole report as text: the head, then the missing line (no GPU) or the results.
    pub fn to_text(&self, explain: bool) -> String {
        let mut s = self.head_text(explain);
        match &self.missing {
            Some(m) => s.push_str(&format!("\n{m}\n")),
            None => s.push_str(&self.results_text()),
        }
        s
    }

    fn first_step_text(&self) -> String {
        let parts: Vec<String> = self
            .runs
            .iter()
            .map(|r| {
                let mut p = format!("{} {:.1} ms", r.variant.title(), r.first_step_ms);
                if r.conv_measure_ms > 0.0 {
                    p.push_str(&format!(" (conv measurements {:.1} ms)", r.conv_measure_ms));
                }
                p
            })
            .collect();
        format!(
            "\nfirst step at batch {} (not timed: auto's measurements, GEMM searches, handles, \
             NVRTC compiles, nnfuse's fused units timed against conv then BN): {}\n",
            self.def.n,
            parts.join(", ")
        )
    }

    fn decisions_text(&self) -> String {
        let mut s = format!(
            "\ndecisions at batch {} (what each operation runs):\n",
            self.def.n
        );
        let titles: Vec<&str> = self.runs.iter().map(|r| r.variant.title()).collect();
        let mut header = vec!["op"];
        header.extend(&titles);
        let rows: Vec<Vec<String>> = STEP
            .iter()
            .enumerate()
            .map(|(k, op)| {
                let mut row = vec![op.name()];
                for r in &self.runs {
                    row.push(r.decisions.get(k).map_or("-".into(), |d| d.route.clone()));
                }
                row
            })
            .collect();
        s.push_str(&table(&header, &rows, &[]));
        if let Some(r) = self.run(Variant::Nnfuse) {
            s.push_str("why (nnfuse):\n");
            for d in &r.decisions {
                s.push_str(&format!("  {:<12} {}\n", d.op.name(), d.detail));
            }
        }
        s
    }

    fn timing_text(&self) -> String {
        let Some(nn) = self.run(Variant::Nnfuse).filter(|r| !r.times.is_empty()) else {
            return String::new();
        };
        let mut s =
            format!(
            "\ntiming: median of {} steps at batch {}, GPU time between CUDA events; each step is \
             queued behind a head start{} so that the host's pace does not count; floor = FLOPs \
             over the H100's datasheet peak or bytes over 3.0 TB/s:\n",
            nn.times.len(),
            self.def.n,
            self.head_start
                .map_or(String::new(), |(n, ms)| format!(" ({n} fills, {:.2} ms)", n as f64 * ms))
        );
        let mut header = vec!["op", "what", "floor us"];
        let titles: Vec<String> = self
            .runs
            .iter()
            .map(|r| format!("{} us", r.variant.title()))
            .collect();
        header.extend(titles.iter().map(String::as_str));
        header.push("nnfuse route");
        let mut rows = Vec::new();
        for (k, op) in STEP.iter().enumerate() {
            let mut row = vec![
                op.name(),
                op.describe(&self.def),
                us(op.floor_us(&self.def) * 1e-3),
            ];
            for r in &self.runs {
                row.push(op_timing(&r.times, k).map_or("-".into(), |t| us(t.median_ms)));
            }
            row.push(
                nn.decisions
                    .get(k)
                    .map_or(String::new(), |d| d.route.clone()),
            );
            rows.push(row);
        }
        rows.push(self.step_row(nn, "GPU, whole step", whole_step));
        if self
            .runs
            .iter()
            .any(|r| bare_step_timing(&r.times).is_some())
        {
            rows.push(self.step_row(nn, "GPU, 2 events only", two_event_step));
        }
        let mut right = vec![false, false, true];
        right.extend(self.runs.iter().map(|_| true));
        s.push_str(&table(&header, &rows, &right));
        if let Some(t) = step_timing(&nn.times) {
            s.push_str(&format!(
                "nnfuse: {:.2} ms per step (p10 {:.2}, p90 {:.2}), {:.0} TFLOP/s on the \
                 convolutions and GEMMs ({:.1} GFLOP per step), {:.0}% of the floor's speed\n",
                t.median_ms,
                t.p10_ms,
                t.p90_ms,
                step_flops(&self.def) / (t.median_ms * 1e-3) / 1e12,
                step_flops(&self.def) / 1e9,
                100.0 * step_floor_us(&self.def) * 1e-3 / t.median_ms
            ));
        }
        s.push_str(&self.host_text(nn));
        let loops: Vec<String> = self
            .runs
            .iter()
            .filter_map(|r| {
                let t = loop_timing(r)?;
                let mut cell = format!("{} {:.2} ms", r.variant.title(), t.median_ms);
                if r.variant != Variant::Nnfuse {
                    if let Some(p) = loop_speedup(nn, r) {
                        cell.push_str(&format!(" ({:.2}x)", p.median));
                    }
                }
                Some(cell)
            })
            .collect();
        if !loops.is_empty() {
            s.push_str(&format!(
                "loop time per step ({} steps queued back to back, one synchronize at the end; \
                 median of {} loops): {}\n",
                self.steps,
                nn.loop_ms.len(),
                loops.join(", ")
            ));
        }
        for r in &self.runs {
            if r.variant == Variant::Nnfuse {
                continue;
            }
            if let Some(p) = speedup(&nn.times, &r.times) {
                s.push_str(&format!(
                    "speed-up over {} ({}): {:.2}x (per-step ratio, p10 {:.2}x, p90 {:.2}x, nnfuse \
                     faster in {}/{} steps)\n",
                    r.variant.title(),
                    r.variant.name(),
                    p.median,
                    p.p10,
                    p.p90,
                    p.rounds - p.faster_rounds,
                    p.rounds
                ));
            }
        }
        s
    }

    /// The host's time to queue one step per variant, both ways: while the GPU is busy (the
    /// headline's) and right after a synchronize (GPU idle).
    fn host_text(&self, nn: &VariantRun) -> String {
        let per_variant = |f: fn(&VariantRun) -> Option<Timing>| -> String {
            self.runs
                .iter()
                .filter_map(|r| {
                    f(r).map(|t| format!("{} {:.3} ms", r.variant.title(), t.median_ms))
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut s = format!(
            "host time to queue one step (validation, dispatch, library calls; median of {} \
             each):\n",
            nn.host_step_ms.len().max(nn.host_busy_ms.len())
        );
        if !nn.host_busy_ms.is_empty() {
            s.push_str(&format!(
                "  while the GPU is busy (queued behind a head start, checked still running at \
                 the end; what a loop that keeps the GPU busy pays, the headline's): {}\n",
                per_variant(host_busy_timing)
            ));
            let idle: Vec<String> = self
                .runs
                .iter()
                .filter(|r| r.host_busy_idle > 0)
                .map(|r| {
                    format!(
                        "{} {}/{}",
                        r.variant.title(),
                        r.host_busy_idle,
                        r.host_busy_ms.len()
                    )
                })
                .collect();
            if !idle.is_empty() {
                s.push_str(&format!(
                    "  note: the GPU finished its head start before the step was queued in {} \
                     samples (a call may wait for the GPU)\n",
                    idle.join(", ")
                ));
            }
        }
        s.push_str(&format!(
            "  right after a synchronize (GPU idle): {}\n",
            per_variant(host_step_timing)
        ));
        s
    }

    /// The whole report as one JSON object.
    pub fn to_json(&self) -> Value {
        let plans: serde_json::Map<String, Value> = self
            .plans
            .iter()
            .map(|p| (p.variant.name().to_string(), p.to_json()))
            .collect();
        let runs: serde_json::Map<String, Value> = self
            .runs
            .iter()
            .map(|r| (r.variant.name().to_string(), self.run_json(r)))
            .collect();
        let d = &self.def;
        json!({
            "command": "demo",
            "status": self.status.name(),
            "exit_code": self.status.code(),
            "missing": self.missing,
            "block": {
                "describe": self.block_line(),
                "batch": d.n,
                "channels": d.c,
                "mid_channels": d.mid,
                "hw": d.hw,
                "fc_in": d.fc_in,
                "fc_out": d.fc_out,
                "dtype": d.dtype.name(),
                "format": d.format.name(),
                "flops_per_step": step_flops(d),
                "floor_us_per_step": step_floor_us(d),
                "ops": STEP.iter().map(|op| json!({
                    "op": op.name(),
                    "what": op.describe(d),
                    "flops": op.flops(d),
                    "bytes": op.bytes(d),
                    "floor_us": op.floor_us(d),
                })).collect::<Vec<_>>(),
            },
            "check_batch": self.check_batch,
            "steps": self.steps,
            "seed": self.seed,
            "environment": self.environment,
            "variants": Variant::ALL.iter().map(|v| json!({
                "name": v.name(), "title": v.title(), "describe": v.describe(),
            })).collect::<Vec<_>>(),
            "plans": Value::Object(plans),
            "plan_basis": self.plan_basis,
            "runs": Value::Object(runs),
            "check": self.check.as_ref().map(check_json),
            "head_start": self.head_start.map(|(n, ms)| json!({"fills": n, "fill_ms": ms})),
            "graph": self.graph.as_ref().map(|g| self.graph_json(g)),
            "host_profile": self.host_profile.as_ref().map(HostProfile::to_json),
            "headline": self.headline_json(),
        })
    }

    fn headline_json(&self) -> Value {
        let text = self.headline();
        if text.is_empty() {
            return Value::Null;
        }
        let nn = self.run(Variant::Nnfuse);
        let med = |t: Option<Timing>| t.map(|t| t.median_ms * 1e3);
        let baselines: serde_json::Map<String, Value> = self
            .runs
            .iter()
            .filter(|r| r.variant != Variant::Nnfuse)
            .map(|r| {
                (
                    r.variant.name().to_string(),
                    json!({
                        "loop_us": med(loop_timing(r)),
                        "speedup_of_nnfuse": nn.and_then(|n| loop_speedup(n, r)).map(|p| p.median),
                    }),
                )
            })
            .collect();
        json!({
            "text": text,
            "loop_us": med(nn.and_then(loop_timing)),
            "host_us": med(nn.and_then(headline_host_timing)),
            "host_busy_us": med(nn.and_then(host_busy_timing)),
            "host_after_sync_us": med(nn.and_then(host_step_timing)),
            "gpu_us": med(nn.and_then(|r| step_timing(&r.times))),
            "baselines": Value::Object(baselines),
            "graph_loop_us": med(self.graph.as_ref().and_then(|g| Timing::from_samples(g.loop_ms.clone()))),
        })
    }

    fn graph_json(&self, g: &GraphReport) -> Value {
        let t = |v: &[f64]| {
            Timing::from_samples(v.to_vec()).map(|t| {
                json!({"median_us": t.median_ms * 1e3, "p10_us": t.p10_ms * 1e3,
                       "p90_us": t.p90_ms * 1e3, "samples": t.iters})
            })
        };
        json!({
            "captured": g.not_capturable.is_none(),
            "not_capturable": g.not_capturable,
            "capture_ms": g.capture_ms,
            "kernel_nodes": g.nodes.map(|n| n.0),
            "other_nodes": g.nodes.map(|n| n.1),
            "passed": g.passed(),
            "outputs": g.rows.iter().map(|r| json!({
                "op": r.op.name(),
                "output": r.quantity,
                "dtype": r.dtype.name(),
                "elements": r.elements,
                "verdict": r.verdict(),
                "ok": r.ok(),
                "graph_differing_elements": r.graph_differs,
                "first_differing": r.first_differing,
                "eager_differing_elements": r.eager_differs,
                "rel_l2": r.compared.as_ref().map(|c| finite(c.rel_l2)),
                "tolerance": r.tol,
            })).collect::<Vec<_>>(),
            "replay": {
                "loop": t(&g.loop_ms),
                "host": t(&g.host_ms),
                "gpu": t(&g.gpu_ms),
                "steps_per_loop": self.steps,
            },
        })
    }

    fn run_json(&self, r: &VariantRun) -> Value {
        let ops: Vec<Value> = STEP
            .iter()
            .enumerate()
            .map(|(k, op)| {
                let t = op_timing(&r.times, k);
                let dec = r.decisions.get(k);
                json!({
                    "op": op.name(),
                    "route": dec.map(|d| d.route.clone()),
                    "detail": dec.map(|d| d.detail.clone()),
                    "median_us": t.map(|t| t.median_ms * 1e3),
                    "p10_us": t.map(|t| t.p10_ms * 1e3),
                    "p90_us": t.map(|t| t.p90_ms * 1e3),
                    "floor_us": op.floor_us(&self.def),
                })
            })
            .collect();
        let step = step_timing(&r.times);
        let nn = self.run(Variant::Nnfuse);
        let sp = nn
            .filter(|n| n.variant != r.variant)
            .and_then(|n| speedup(&n.times, &r.times));
        json!({
            "first_step_ms": r.first_step_ms,
            "conv_measure_ms": r.conv_measure_ms,
            "ops": ops,
            "step_median_us": step.map(|t| t.median_ms * 1e3),
            "step_p10_us": step.map(|t| t.p10_ms * 1e3),
            "step_p90_us": step.map(|t| t.p90_ms * 1e3),
            "step_two_events_median_us": bare_step_timing(&r.times).map(|t| t.median_ms * 1e3),
            "host_queue_median_us": host_timing(&r.times).map(|t| t.median_ms * 1e3),
            "host_step_median_us": host_step_timing(r).map(|t| t.median_ms * 1e3),
            "host_step_p10_us": host_step_timing(r).map(|t| t.p10_ms * 1e3),
            "host_step_p90_us": host_step_timing(r).map(|t| t.p90_ms * 1e3),
            "host_busy_median_us": host_busy_timing(r).map(|t| t.median_ms * 1e3),
            "host_busy_p10_us": host_busy_timing(r).map(|t| t.p10_ms * 1e3),
            "host_busy_p90_us": host_busy_timing(r).map(|t| t.p90_ms * 1e3),
            "host_busy_samples": r.host_busy_ms.len(),
            "host_busy_gpu_went_idle": r.host_busy_idle,
            "loop_median_us": loop_timing(r).map(|t| t.median_ms * 1e3),
            "loop_p10_us": loop_timing(r).map(|t| t.p10_ms * 1e3),
            "loop_p90_us": loop_timing(r).map(|t| t.p90_ms * 1e3),
            "loops": r.loop_ms.len(),
            "steps_per_loop": self.steps,
            "loop_speedup_of_nnfuse": nn
                .filter(|n| n.variant != r.variant)
                .and_then(|n| loop_speedup(n, r))
                .map(|p| json!({
                    "median": p.median, "p10": p.p10, "p90": p.p90,
                    "nnfuse_faster_loops": p.rounds - p.faster_rounds, "loops": p.rounds,
                })),
            "steps_timed": r.times.len(),
            "speedup_of_nnfuse": sp.map(|p| json!({
                "median": p.median, "p10": p.p10, "p90": p.p90,
                "nnfuse_faster_steps": p.rounds - p.faster_rounds, "steps": p.rounds,
            })),
        })
    }
}

/// The check as text: one row per quantity, one column per variant.
pub fn check_text(c: &CheckReport) -> String {
    let mut s = format!(
        "\ncheck: every output against an f64 reference computed from that operation's own \
         inputs, batch {} (the classifier at the timed batch), relative L2 error (tolerance: \
         f32 1e-5, f16/bf16 1e-2; a Winograd route the dispatcher's own, f32 1e-4, bf16 2e-2):\n",
        c.batch
    );
    let Some((_, first)) = c.rows.first() else {
        return s;
    };
    let mut header = vec!["op", "output"];
    let titles: Vec<&str> = c.rows.iter().map(|(v, _)| v.title()).collect();
    header.extend(&titles);
    header.push("tolerance");
    let mut rows = Vec::new();
    for (k, r) in first.iter().enumerate() {
        let mut row = vec![r.op.name(), r.quantity.to_string()];
        let mut tol = r.tol;
        for (_, vr) in &c.rows {
            match vr.get(k) {
                Some(x) => {
                    let mark = if x.ok() { "" } else { " FAIL" };
                    row.push(format!("{}{mark}", sci(x.compared.rel_l2)));
                    tol = tol.max(x.tol);
                }
                None => row.push("-".into()),
            }
        }
        row.push(sci(tol));
        rows.push(row);
    }
    let mut right = vec![false, false];
    right.extend(c.rows.iter().map(|_| true));
    right.push(true);
    s.push_str(&table(&header, &rows, &right));
    for n in &c.notes {
        s.push_str(&format!("note: {n}\n"));
    }
    let failed: Vec<String> = c
        .rows
        .iter()
        .flat_map(|(v, rows)| {
            rows.iter().filter(|r| !r.ok()).map(move |r| {
                let (i, got, want) = r.compared.worst;
                format!(
                    "{} {}: relative L2 {} > {} (worst element {i}: got {got} want {want}; first \
                     non-finite {:?}; {} elements)",
                    v.title(),
                    r.label(),
                    sci(r.compared.rel_l2),
                    sci(r.tol),
                    r.compared.first_nonfinite,
                    r.compared.len
                )
            })
        })
        .collect();
    if failed.is_empty() {
        s.push_str(&format!("check PASSED ({} comparisons)\n", c.count()));
    } else {
        s.push_str(&format!(
            "check FAILED ({} of {} comparisons):\n",
            failed.len(),
            c.count()
        ));
        for f in failed {
            s.push_str(&format!("  {f}\n"));
        }
    }
    s
}

fn check_json(c: &CheckReport) -> Value {
    let per: serde_json::Map<String, Value> = c
        .rows
        .iter()
        .map(|(v, rows)| {
            let rows: Vec<Value> = rows
                .iter()
                .map(|r| {
                    let (i, got, want) = r.compared.worst;
                    json!({
                        "op": r.op.name(),
                        "output": r.quantity,
                        "rel_l2": if r.compared.rel_l2.is_finite() { json!(r.compared.rel_l2) } else { Value::Null },
                        "tolerance": r.tol,
                        "ok": r.ok(),
                        "elements": r.compared.len,
                        "first_nonfinite": r.compared.first_nonfinite,
                        "worst": {"index": i, "got": finite(got), "want": finite(want)},
                    })
                })
                .collect();
            (v.name().to_string(), Value::Array(rows))
        })
        .collect();
    json!({
        "batch": c.batch,
        "passed": c.passed(),
        "comparisons": c.count(),
        "notes": c.notes,
        "rows": Value::Object(per),
    })
}

/// How the replay matched: `outputs bit-identical to eager (31)`, or with the outputs eager
/// itself does not reproduce counted apart.
fn graph_match(g: &GraphReport) -> String {
    let same = g.rows.iter().filter(|r| r.graph_differs == 0).count();
    let loose = g.rows.len() - same;
    if loose == 0 {
        format!("outputs bit-identical to eager ({same} outputs)")
    } else {
        format!(
            "{same} of {} outputs bit-identical to eager, {loose} that two eager steps do not \
             reproduce bit for bit compared within the tolerance",
            g.rows.len()
        )
    }
}

/// JSON has no NaN: non-finite numbers become null.
fn finite(v: f64) -> Value {
    if v.is_finite() {
        json!(v)
    } else {
        Value::Null
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::demo::plans::plan_block;
    use crate::demo::reference::compare;
    use nnfuse::batchnorm::ASSUMED_CUDNN_VERSION;
    use nnfuse::{DType, TensorFormat};

    fn report(status: Status) -> Report {
        let def = BlockDef::resnet50(32, DType::F16, TensorFormat::Nhwc);
        let plans = Variant::ALL
            .iter()
            .map(|&v| plan_block(&def, v, &Config::default(), true, ASSUMED_CUDNN_VERSION).unwrap())
            .collect();
        Report {
            def,
            check_batch: Some(2),
            steps: 3,
            seed: 42,
            config: Config::default(),
            environment: vec!["device 0: test".into()],
            plans,
            plan_basis: "cuDNN 9.19.0 assumed".into(),
            missing: None,
            runs: Vec::new(),
            check: None,
            head_start: Some((10, 0.1)),
            graph: None,
            host_profile: None,
            status,
        }
    }

    fn times(total: f64) -> StepTimes {
        StepTimes {
            ops_ms: vec![total / STEP.len() as f64; STEP.len()],
            total_ms: total,
            host_ms: 0.3,
            bare_ms: None,
        }
    }

    #[test]
    fn tables_pad_columns() {
        let t = table(
            &["a", "bb"],
            &[vec!["xxx".into(), "1".into()]],
            &[false, true],
        );
        assert_eq!(t, " a    bb\n xxx   1\n");
    }

    #[test]
    fn no_gpu_report_has_the_plans_and_the_missing_line() {
        let mut r = report(Status::NoGpu);
        r.missing = Some("nnfuse demo cannot run here: no CUDA driver".into());
        let text = r.to_text(false);
        assert!(text.contains("conv2.fwd"), "{text}");
        assert!(text.contains("bn3 (fwd+bwd)"), "{text}");
        assert!(text.trim_end().ends_with("no CUDA driver"), "{text}");
        assert!(!text.contains("timing:"));
        let j = r.to_json();
        assert_eq!(j["status"], "no_gpu");
        assert_eq!(j["exit_code"], 3);
        assert_eq!(j["block"]["ops"].as_array().unwrap().len(), STEP.len());
        assert!(j["plans"]["nnfuse"]["layers"]["conv1"]["forward"]["path"].is_string());
        assert!(j["check"].is_null());
        let full = r.to_text(true);
        assert!(full.contains("full plans of cuDNN SPATIAL"), "{full}");
    }

    #[test]
    fn timing_and_speedups_are_reported_per_variant() {
        let mut r = report(Status::Ok);
        for (v, t) in [
            (Variant::Nnfuse, 1.0),
            (Variant::CudnnSpatial, 4.0),
            (Variant::CudnnPersistent, 2.0),
        ] {
            r.runs.push(VariantRun {
                variant: v,
                first_step_ms: 100.0,
                conv_measure_ms: if v == Variant::Nnfuse { 50.0 } else { 0.0 },
                decisions: STEP
                    .iter()
                    .map(|&op| Decision {
                        op,
                        route: format!("{}-route", v.name()),
                        detail: "why".into(),
                    })
                    .collect(),
                times: vec![times(t), times(t * 1.1), times(t * 0.9)],
                loop_ms: vec![t * 1.2, t * 1.3, t * 1.1],
                host_step_ms: vec![0.4, 0.5, 0.3],
                host_busy_ms: Vec::new(),
                host_busy_idle: 0,
            });
        }
        let text = r.to_text(false);
        assert!(text.contains("(4.00x)"), "{text}");
        assert!(
            text.contains("speed-up over cuDNN persistent (cudnn_persistent): 2.00x"),
            "{text}"
        );
        assert!(text.contains("nnfuse-route"));
        let j = r.to_json();
        let sp = &j["runs"]["cudnn_spatial"]["speedup_of_nnfuse"];
        assert!((sp["median"].as_f64().unwrap() - 4.0).abs() < 1e-12, "{sp}");
        assert_eq!(
            j["runs"]["nnfuse"]["ops"].as_array().unwrap().len(),
            STEP.len()
        );
        assert!(j["runs"]["nnfuse"]["speedup_of_nnfuse"].is_null());
        assert!((j["runs"]["nnfuse"]["step_median_us"].as_f64().unwrap() - 1000.0).abs() < 1e-9);
        // Without busy-GPU samples the headline falls back on the after-synchronize host time.
        assert!((j["headline"]["host_us"].as_f64().unwrap() - 400.0).abs() < 1e-9);
        assert!(j["headline"]["host_busy_us"].is_null());
        assert!(!text.contains("while the GPU is busy"), "{text}");
        // A busy sample whose head start ran out is reported.
        r.runs[1].host_busy_ms = vec![0.5, 0.6];
        r.runs[1].host_busy_idle = 1;
        r.runs[0].host_busy_ms = vec![0.2, 0.2];
        let text = r.to_text(false);
        assert!(
            text.contains(
                "note: the GPU finished its head start before the step was queued in cuDNN \
                 SPATIAL 1/2 samples"
            ),
            "{text}"
        );
        assert_eq!(
            r.to_json()["runs"]["cudnn_spatial"]["host_busy_gpu_went_idle"],
            1
        );
    }

    fn timed_report() -> Report {
        let mut r = report(Status::Ok);
        for (v, t) in [
            (Variant::Nnfuse, 1.0),
            (Variant::CudnnSpatial, 4.0),
            (Variant::CudnnPersistent, 2.0),
        ] {
            r.runs.push(VariantRun {
                variant: v,
                first_step_ms: 100.0,
                conv_measure_ms: 0.0,
                decisions: Vec::new(),
                times: vec![times(t), times(t), times(t)],
                loop_ms: vec![t * 1.25, t * 1.5, t * 1.5],
                host_step_ms: vec![0.375, 0.375, 0.5],
                host_busy_ms: vec![0.25, 0.25, 0.3],
                host_busy_idle: 0,
            });
        }
        r
    }

    fn bit_rows(graph: &[u8]) -> Vec<BitRow> {
        let eager = [0u8, 60, 0, 64];
        crate::demo::bits::OUTPUTS
            .iter()
            .map(|&(op, q, _)| BitRow::of((op, q, DType::F16), &eager, &eager, graph, 1e-2))
            .collect()
    }

    #[test]
    fn the_two_event_step_time_gets_a_row_a_headline_mention_and_a_json_field() {
        let mut r = timed_report();
        for run in &mut r.runs {
            let bare = if run.variant == Variant::Nnfuse {
                0.9
            } else {
                3.6
            };
            for t in &mut run.times {
                t.bare_ms = Some(bare);
            }
        }
        let head = r.headline();
        assert!(
            head[0].starts_with(
                "nnfuse step: loop 1.50 ms (host 0.25 ms, GPU 1.00 ms; 0.90 ms without \
                 per-operation events) — "
            ),
            "{head:?}"
        );
        let text = r.to_text(false);
        let row = text
            .lines()
            .find(|l| l.contains("GPU, 2 events only"))
            .unwrap_or_else(|| panic!("no two-event row: {text}"));
        assert!(
            row.contains("900.0") && row.contains("3600.0 (4.00x)"),
            "{row}"
        );
        let j = r.to_json();
        let us = j["runs"]["nnfuse"]["step_two_events_median_us"]
            .as_f64()
            .unwrap();
        assert!((us - 900.0).abs() < 1e-9, "{us}");
        // Without samples: no row, the headline as before.
        let plain = timed_report();
        assert!(!plain.to_text(false).contains("2 events only"));
        assert!(!plain.headline()[0].contains("without per-operation events"));
    }

    #[test]
    fn the_headline_is_the_loop_time_against_each_baselines_loop() {
        let r = timed_report();
        let head = r.headline();
        assert_eq!(
            head,
            [
                "nnfuse step: loop 1.50 ms (host 0.25 ms, GPU 1.00 ms) — cuDNN SPATIAL loop 6.00 \
              ms: 4.00x, cuDNN persistent loop 3.00 ms: 2.00x"
            ]
        );
        let text = r.to_text(false);
        assert!(text.trim_end().ends_with(&head[0]), "{text}");
        assert!(
            text.contains(
                "loop time per step (3 steps queued back to back, one synchronize at \
                           the end; median of 3 loops): nnfuse 1.50 ms, cuDNN SPATIAL 6.00 ms \
                           (4.00x)"
            ),
            "{text}"
        );
        assert!(text.contains("host time to queue one step"), "{text}");
        let j = r.to_json();
        assert_eq!(j["headline"]["text"][0], head[0].as_str());
        assert!((j["headline"]["loop_us"].as_f64().unwrap() - 1500.0).abs() < 1e-9);
        // The headline's host time is the busy-GPU one; the after-synchronize one is kept.
        assert!((j["headline"]["host_us"].as_f64().unwrap() - 250.0).abs() < 1e-9);
        assert!((j["headline"]["host_busy_us"].as_f64().unwrap() - 250.0).abs() < 1e-9);
        assert!((j["headline"]["host_after_sync_us"].as_f64().unwrap() - 375.0).abs() < 1e-9);
        assert!(
            text.contains(
                "  while the GPU is busy (queued behind a head start, checked still running at \
                 the end; what a loop that keeps the GPU busy pays, the headline's): nnfuse \
                 0.250 ms, cuDNN SPATIAL 0.250 ms, cuDNN persistent 0.250 ms\n  right after a \
                 synchronize (GPU idle): nnfuse 0.375 ms,"
            ),
            "{text}"
        );
        assert!(!text.contains("note: the GPU finished"), "{text}");
        assert!((j["headline"]["gpu_us"].as_f64().unwrap() - 1000.0).abs() < 1e-9);
        let sp = &j["headline"]["baselines"]["cudnn_spatial"];
        assert!(
            (sp["speedup_of_nnfuse"].as_f64().unwrap() - 4.0).abs() < 1e-12,
            "{sp}"
        );
        let nn = &j["runs"]["nnfuse"];
        assert!((nn["loop_median_us"].as_f64().unwrap() - 1500.0).abs() < 1e-9);
        assert!((nn["host_step_median_us"].as_f64().unwrap() - 375.0).abs() < 1e-9);
        assert!((nn["host_busy_median_us"].as_f64().unwrap() - 250.0).abs() < 1e-9);
        assert_eq!(nn["host_busy_samples"], 3);
        assert_eq!(nn["host_busy_gpu_went_idle"], 0);
        assert!(j["host_profile"].is_null());
        assert_eq!(nn["loops"], 3);
        assert_eq!(nn["steps_per_loop"], 3);
        assert!(nn["loop_speedup_of_nnfuse"].is_null());
        let lsp = &j["runs"]["cudnn_persistent"]["loop_speedup_of_nnfuse"];
        assert!(
            (lsp["median"].as_f64().unwrap() - 2.0).abs() < 1e-12,
            "{lsp}"
        );
        assert!(j["graph"].is_null());
        // Nothing timed: no headline.
        assert!(report(Status::CheckFailed).headline().is_empty());
        assert!(report(Status::CheckFailed).to_json()["headline"].is_null());
    }

    #[test]
    fn the_host_profile_follows_the_timing_and_is_in_the_json() {
        let mut r = timed_report();
        let mut p = HostProfile::new();
        for o in &mut p.ops {
            o.wall_ms.push(0.01);
        }
        r.host_profile = Some(p);
        let text = r.to_text(false);
        let at = |needle: &str| {
            text.find(needle)
                .unwrap_or_else(|| panic!("{needle}: {text}"))
        };
        assert!(at("loop time per step") < at("host profile (--profile-host)"));
        assert!(at("host profile (--profile-host)") < at("nnfuse step: loop"));
        // The profiled step (19 operations of 10 µs) beside the unprofiled busy-GPU median.
        assert!(
            text.contains("profiled step: 190.0 µs median")
                && text.contains("unprofiled, while the GPU is busy: 250.0 µs"),
            "{text}"
        );
        let j = r.to_json();
        assert_eq!(j["host_profile"]["steps"], 1);
        assert_eq!(
            j["host_profile"]["ops"].as_array().unwrap().len(),
            STEP.len()
        );
    }

    #[test]
    fn a_graph_that_replays_bit_identical_is_timed_and_headlined() {
        let mut r = timed_report();
        r.graph = Some(GraphReport {
            not_capturable: None,
            capture_ms: 12.0,
            nodes: Some((47, 2)),
            rows: bit_rows(&[0, 60, 0, 64]),
            loop_ms: vec![0.9, 0.95, 0.92],
            host_ms: vec![0.007, 0.008, 0.006],
            gpu_ms: vec![0.9, 0.9, 0.9],
        });
        assert!(r.graph.as_ref().unwrap().passed());
        let head = r.headline();
        assert_eq!(
            head[1],
            "nnfuse graph: replay loop 0.92 ms (host 0.007 ms, GPU 0.90 ms), outputs \
             bit-identical to eager (31 outputs)"
        );
        let text = r.to_text(false);
        assert!(
            text.contains("graph check PASSED: outputs bit-identical to eager (31 outputs)"),
            "{text}"
        );
        assert!(
            text.contains("graph replay: loop 0.92 ms per step"),
            "{text}"
        );
        assert!(
            text.contains("upload; 47 kernel launches and 2 other nodes)"),
            "{text}"
        );
        let j = r.to_json();
        let g = &j["graph"];
        assert_eq!(g["kernel_nodes"], 47);
        assert_eq!(g["other_nodes"], 2);
        assert_eq!(g["captured"], true);
        assert_eq!(g["passed"], true);
        assert_eq!(g["outputs"].as_array().unwrap().len(), 31);
        assert_eq!(g["outputs"][0]["verdict"], "identical");
        assert!((g["replay"]["host"]["median_us"].as_f64().unwrap() - 7.0).abs() < 1e-9);
        assert!((j["headline"]["graph_loop_us"].as_f64().unwrap() - 920.0).abs() < 1e-9);
    }

    #[test]
    fn a_graph_that_differs_or_cannot_be_captured_says_why() {
        let mut r = timed_report();
        r.status = Status::GraphDiffers;
        r.graph = Some(GraphReport {
            capture_ms: 12.0,
            rows: bit_rows(&[0, 60, 1, 64]),
            ..GraphReport::default()
        });
        assert!(!r.graph.as_ref().unwrap().passed());
        let text = r.to_text(false);
        assert!(
            text.contains("graph check FAILED (31 of 31 outputs"),
            "{text}"
        );
        assert!(
            text.contains("conv2.wgrad dw: 1 of 2 elements differ (first at 1)"),
            "{text}"
        );
        assert_eq!(r.headline().len(), 1, "no replay timing, no graph headline");
        let j = r.to_json();
        assert_eq!(j["status"], "graph_differs");
        assert_eq!(j["exit_code"], 1);
        assert_eq!(j["graph"]["outputs"][0]["verdict"], "differs");
        assert_eq!(j["graph"]["outputs"][0]["first_differing"], 1);
        assert!(j["graph"]["replay"]["loop"].is_null());

        r.status = Status::NotCapturable;
        r.graph = Some(GraphReport {
            not_capturable: Some("a call failed under capture: conv2.fwd (nnfuse): X".into()),
            ..GraphReport::default()
        });
        let text = r.to_text(false);
        assert!(
            text.contains(
                "could not be captured into a CUDA graph (0.0 ms): a call failed under \
                           capture: conv2.fwd (nnfuse): X (exit status 4)"
            ),
            "{text}"
        );
        let j = r.to_json();
        assert_eq!(j["exit_code"], 4);
        assert_eq!(j["status"], "not_capturable");
        assert_eq!(j["graph"]["captured"], false);
        assert!(j["graph"]["not_capturable"]
            .as_str()
            .unwrap()
            .contains("conv2.fwd"));
    }

    #[test]
    fn a_failed_check_names_the_worst_element() {
        let row = |ok: bool| Row {
            op: Op::ConvWgrad(1),
            quantity: "dw",
            compared: compare(&[1.0, if ok { 2.0 } else { 2.5 }], &[1.0, 2.0]),
            tol: 1e-2,
        };
        let c = CheckReport {
            batch: 2,
            rows: vec![
                (Variant::Nnfuse, vec![row(false)]),
                (Variant::CudnnSpatial, vec![row(true)]),
            ],
            notes: vec![],
        };
        assert!(!c.passed());
        let t = check_text(&c);
        assert!(t.contains("check FAILED (1 of 2 comparisons)"), "{t}");
        assert!(t.contains("nnfuse conv2.wgrad dw"), "{t}");
        assert!(t.contains("worst element 1: got 2.5 want 2"), "{t}");
        let j = check_json(&c);
        assert_eq!(j["passed"], false);
        assert_eq!(j["rows"]["nnfuse"][0]["ok"], false);
    }
}
