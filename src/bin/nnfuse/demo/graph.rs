//! `nnfuse demo --graph`: one whole nnfuse training step captured into a CUDA graph on the
//! Context's stream, replayed, checked bit for bit against eager steps on the same inputs, and
//! timed, through the library's `Context::capture`.

use std::time::Instant;

use anyhow::Result;
use nnfuse::{Context, Element};

use super::bits::{BitRow, OUTPUTS};
use super::check::tolerance;
use super::gpu::{new_event, run_step, Buffers, HeadStart, Layers};
use super::report::GraphReport;

/// A captured step, ready to be replayed on the stream it was captured on.
pub struct CapturedStep {
    graph: nnfuse::capture::CapturedGraph,
}

impl CapturedStep {
    /// Queues one replay of the whole step (one `cuGraphLaunch`).
    pub fn replay(&self) -> Result<()> {
        Ok(self.graph.replay()?)
    }
}

/// Captures everything `queue` puts on `ctx`'s stream into a CUDA graph through the library's
/// [`Context::capture`] (instantiated and uploaded; nothing runs). `Err` carries, in words, why
/// the step could not be captured: the failing call's error (an undecided call's typed
/// capture error, or the driver's). The stream is usable again either way.
///
/// cudarc's per-buffer event tracking must be off (see `demo::run`): `Context::capture`
/// refuses otherwise, saying so.
pub fn capture(
    ctx: &Context,
    queue: impl FnOnce(&Context) -> Result<()>,
) -> std::result::Result<CapturedStep, String> {
    ctx.synchronize()
        .map_err(|e| format!("before the capture: {e}"))?;
    let graph = ctx
        .capture(|c| queue(c).map_err(|e| nnfuse::Error::NotSupported(format!("{e:#}"))))
        .map_err(|e| format!("the step could not be captured: {e}"))?;
    graph
        .upload()
        .map_err(|e| format!("cuGraphUpload failed: {e}"))?;
    Ok(CapturedStep { graph })
}

/// Raw bytes of every output of the step `queue_step` queues on fresh poison, each step
/// starting from the running statistics `stats`.
fn outputs_after<T: Element>(
    ctx: &Context,
    b: &mut Buffers<T>,
    stats: &[Vec<f32>],
    queue_step: &mut dyn FnMut(&mut Buffers<T>) -> Result<()>,
) -> Result<Vec<Vec<u8>>> {
    b.set_running_stats(ctx, stats)?;
    b.poison(ctx)?;
    queue_step(b)?;
    let out = b.raw_outputs(ctx)?;
    if out.len() != OUTPUTS.len() {
        anyhow::bail!("{} outputs read, {} listed", out.len(), OUTPUTS.len());
    }
    Ok(out)
}

/// The graph phase on nnfuse's layers `l` (decided: after the warm-up steps): an eager step,
/// the capture, a replay and a second eager step, each on the same inputs and running
/// statistics with every output poisoned first; every output's bits compared. When they match,
/// `loops` loops of `steps` replays (wall clock, one synchronize per loop), the host time of
/// `steps` single replays queued on an idle GPU, and the GPU time of `steps` replays behind a
/// head start.
pub fn run<T: Element>(
    l: &Layers<T>,
    b: &mut Buffers<T>,
    steps: usize,
    loops: usize,
) -> Result<GraphReport> {
    let ctx = &l.ctx;
    let stats = b.running_stats(ctx)?;
    let mut eager = |b: &mut Buffers<T>| run_step(l, b, &mut |_| Ok(()));
    let first = outputs_after(ctx, b, &stats, &mut eager)?;
    let t = Instant::now();
    let captured = capture(ctx, |_| run_step(l, b, &mut |_| Ok(())));
    let capture_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut report = GraphReport {
        capture_ms,
        ..GraphReport::default()
    };
    let g = match captured {
        Ok(g) => g,
        Err(why) => {
            report.not_capturable = Some(why);
            return Ok(report);
        }
    };
    report.nodes = g.graph.node_counts().ok();
    let replayed = outputs_after(ctx, b, &stats, &mut |_| g.replay())?;
    let again = outputs_after(ctx, b, &stats, &mut eager)?;
    for (k, &(op, quantity, is_f32)) in OUTPUTS.iter().enumerate() {
        let dtype = if is_f32 { nnfuse::DType::F32 } else { T::DTYPE };
        let route = op.conv().and_then(|(i, d)| l.route(i, d));
        report.rows.push(BitRow::of(
            (op, quantity, dtype),
            &first[k],
            &again[k],
            &replayed[k],
            tolerance(op, T::DTYPE, route),
        ));
    }
    b.set_running_stats(ctx, &stats)?;
    if !report.passed() {
        return Ok(report);
    }
    time_replays(ctx, &g, steps, loops, &mut report)?;
    Ok(report)
}

/// The replay timings into `report`.
fn time_replays(
    ctx: &Context,
    g: &CapturedStep,
    steps: usize,
    loops: usize,
    report: &mut GraphReport,
) -> Result<()> {
    // One loop first, not counted (the graph's first launches).
    for k in 0..=loops {
        ctx.synchronize()?;
        let t = Instant::now();
        for _ in 0..steps {
            g.replay()?;
        }
        ctx.synchronize()?;
        if k > 0 {
            report
                .loop_ms
                .push(t.elapsed().as_secs_f64() * 1e3 / steps as f64);
        }
    }
    for _ in 0..steps {
        ctx.synchronize()?;
        let t = Instant::now();
        g.replay()?;
        report.host_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let mut head = HeadStart::new(ctx, 0.05)?;
    let (a, z) = (new_event(ctx)?, new_event(ctx)?);
    for _ in 0..steps {
        ctx.synchronize()?;
        head.queue(ctx)?;
        a.record(ctx.stream())?;
        g.replay()?;
        z.record(ctx.stream())?;
        z.synchronize()?;
        report.gpu_ms.push(a.elapsed_ms(&z)? as f64);
    }
    ctx.synchronize()?;
    Ok(())
}
