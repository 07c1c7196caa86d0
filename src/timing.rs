//! GPU timing with CUDA events on the Context's stream: warm-up, then one event pair per
//! iteration, median of many. Used by the GEMM search and by every benchmark (never by tests).

use std::fmt;

use cudarc::driver::{sys as drv, CudaSlice};

use crate::context::Context;
use crate::error::{CallExt, Result};

/// Statistics of repeated GPU runs, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Median.
    pub median_ms: f64,
    /// Fastest.
    pub min_ms: f64,
    /// 10th percentile.
    pub p10_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// Timed iterations.
    pub iters: usize,
}

impl Timing {
    /// Median in microseconds.
    pub fn median_us(&self) -> f64 {
        self.median_ms * 1e3
    }

    /// From per-iteration samples (ms). `None` for no samples.
    pub fn from_samples(mut s: Vec<f64>) -> Option<Timing> {
        if s.is_empty() {
            return None;
        }
        s.sort_by(|a, b| a.total_cmp(b));
        let at = |q: f64| s[((s.len() - 1) as f64 * q).round() as usize];
        Some(Timing {
            median_ms: at(0.5),
            min_ms: s[0],
            p10_ms: at(0.1),
            p90_ms: at(0.9),
            iters: s.len(),
        })
    }
}

impl fmt::Display for Timing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:.2} us median (p10 {:.2}, p90 {:.2}, n={})",
            self.median_ms * 1e3,
            self.p10_ms * 1e3,
            self.p90_ms * 1e3,
            self.iters
        )
    }
}

/// How long to measure.
#[derive(Debug, Clone, Copy)]
pub struct TimingOptions {
    /// Untimed runs first (module load, handle creation, clocks).
    pub warmup: usize,
    /// Most timed runs.
    pub max_iters: usize,
    /// Fewest timed runs.
    pub min_iters: usize,
    /// Stop adding runs once this much GPU time (ms) has been measured.
    pub budget_ms: f64,
}

impl Default for TimingOptions {
    fn default() -> Self {
        TimingOptions {
            warmup: 5,
            max_iters: 200,
            min_iters: 20,
            budget_ms: 300.0,
        }
    }
}

/// Runs `f(i)` for warm-up and timed iterations on the Context's stream; `i` counts from 0 over
/// all calls, so that callers can rotate buffers (`i % copies`). `f` must only queue work on
/// `ctx.stream()`.
pub fn time_gpu(
    ctx: &Context,
    opts: TimingOptions,
    mut f: impl FnMut(usize) -> Result<()>,
) -> Result<Timing> {
    let stream = ctx.stream();
    let mut i = 0usize;
    for _ in 0..opts.warmup {
        f(i)?;
        i += 1;
    }
    ctx.synchronize()?;
    let new_event = || {
        ctx.cuda()
            .new_event(Some(drv::CUevent_flags::CU_EVENT_DEFAULT))
            .call("cuEventCreate")
    };
    let mut samples = Vec::with_capacity(opts.max_iters);
    let mut spent = 0.0;
    // Batches of events so that the host queues ahead of the GPU (no sync per iteration).
    while samples.len() < opts.max_iters.max(1) {
        let batch = (opts.max_iters - samples.len()).clamp(1, 20);
        let mut events = Vec::with_capacity(batch);
        for _ in 0..batch {
            let (a, b) = (new_event()?, new_event()?);
            a.record(stream).call("cuEventRecord")?;
            f(i)?;
            i += 1;
            b.record(stream).call("cuEventRecord")?;
            events.push((a, b));
        }
        for (a, b) in &events {
            b.synchronize().call("cuEventSynchronize")?;
            let ms = a.elapsed_ms(b).call("cuEventElapsedTime")? as f64;
            spent += ms;
            samples.push(ms);
        }
        if samples.len() >= opts.min_iters && spent >= opts.budget_ms {
            break;
        }
    }
    Ok(Timing::from_samples(samples).unwrap_or(Timing {
        median_ms: f64::NAN,
        min_ms: f64::NAN,
        p10_ms: f64::NAN,
        p90_ms: f64::NAN,
        iters: 0,
    }))
}

/// Measures the device-to-device copy bandwidth in bytes per second, counting bytes read plus
/// bytes written, with a copy of `bytes` bytes (use ≥ 1 GiB on large GPUs).
pub fn copy_bandwidth(ctx: &Context, bytes: usize) -> Result<f64> {
    let stream = ctx.stream();
    let src: CudaSlice<u8> = stream.alloc_zeros(bytes).call("cuMemAlloc")?;
    let mut dst: CudaSlice<u8> = stream.alloc_zeros(bytes).call("cuMemAlloc")?;
    let t = time_gpu(
        ctx,
        TimingOptions {
            warmup: 3,
            max_iters: 30,
            min_iters: 10,
            budget_ms: 200.0,
        },
        |_| stream.memcpy_dtod(&src, &mut dst).call("cuMemcpyDtoDAsync"),
    )?;
    Ok(2.0 * bytes as f64 / (t.median_ms * 1e-3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics_of_samples() {
        let t = Timing::from_samples(vec![5.0, 1.0, 3.0, 2.0, 4.0]).unwrap();
        assert_eq!(t.median_ms, 3.0);
        assert_eq!(t.min_ms, 1.0);
        assert_eq!(t.iters, 5);
        assert!(Timing::from_samples(vec![]).is_none());
        assert!((t.median_us() - 3000.0).abs() < 1e-9);
    }
}
