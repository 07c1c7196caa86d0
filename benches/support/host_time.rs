//! Host and GPU time of one call, measured the same way by the benches that report host cost.

use std::time::Instant;

use nnfuse::internals::timing::{time_gpu, TimingOptions};
use nnfuse::Context;

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Host µs per call of `f` over `rounds` rounds of `calls` back-to-back calls (median over
/// rounds), synchronising after each round, not inside it.
pub fn loop_us(
    ctx: &Context,
    mut f: impl FnMut() -> nnfuse::Result<()>,
    calls: usize,
    rounds: usize,
) -> nnfuse::Result<f64> {
    let mut v = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        for _ in 0..calls {
            f()?;
        }
        v.push(t.elapsed().as_secs_f64() * 1e6 / calls as f64);
        ctx.synchronize()?;
    }
    Ok(median(v))
}

/// Host µs to queue one call of `f` right after a synchronize (median of 31, the synchronize
/// not timed); synchronises at the end.
pub fn queue_us(ctx: &Context, mut f: impl FnMut() -> nnfuse::Result<()>) -> nnfuse::Result<f64> {
    let mut v = Vec::new();
    for _ in 0..31 {
        ctx.synchronize()?;
        let t = Instant::now();
        f()?;
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    ctx.synchronize()?;
    Ok(median(v))
}

/// GPU µs of one call of `f` (median of CUDA-event samples within `budget_ms`).
pub fn gpu_us(
    ctx: &Context,
    mut f: impl FnMut() -> nnfuse::Result<()>,
    budget_ms: f64,
) -> nnfuse::Result<f64> {
    let gpu = time_gpu(
        ctx,
        TimingOptions {
            warmup: 3,
            max_iters: 50,
            min_iters: 20,
            budget_ms,
        },
        |_| f(),
    )?;
    Ok(gpu.median_us())
}
