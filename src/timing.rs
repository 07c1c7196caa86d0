//! GPU timing with CUDA events on the Context's stream. Used by the GEMM search and by every
//! benchmark (never by tests).
//!
//! - [`time_gpu`]: one piece of work, warm-up, then one event pair per iteration, median of many.
//! - [`time_interleaved`]: several variants of one piece of work *against each other*: each
//!   sample is a burst of back-to-back launches of one variant between two events (enough
//!   launches that the sample covers [`InterleavedOptions::min_sample_ms`] of GPU time), and the
//!   variants take turns round-robin (round 1 of every variant, then round 2 of every variant,
//!   ...), so that clock and thermal drift, which on an H100 moves a 3 ms GEMM by 5-10 % within
//!   seconds, hits every variant alike. Because round `r` of two variants ran within
//!   milliseconds of each other, the per-round ratio of their times ([`Paired`]) cancels the
//!   drift that their medians alone would still carry.
//! - [`time_interleaved_gpu`]: the same, measuring GPU time only: every sample is queued behind a
//!   head start of GPU work (one launch of a kernel that waits on the GPU's clock) that covers
//!   the host time of queuing it, so that a variant whose calls queue slower than the GPU runs
//!   them (legacy cuDNN: 60-100 us of host time per call) is judged by its GPU time, not by its
//!   host time.

use std::fmt;

use std::time::Instant;

use cudarc::driver::{sys as drv, CudaEvent, CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use crate::context::Context;
use crate::cudnn_graph::replay::suspended;
use crate::error::{CallExt, Result};
use crate::kernels;

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
        // A dropped sample is NaN (it keeps the rounds of a variant aligned with the others').
        s.retain(|v| v.is_finite());
        if s.is_empty() {
            return None;
        }
        s.sort_by(|a, b| a.total_cmp(b));
        Some(Timing {
            median_ms: quantile(&s, 0.5),
            min_ms: s[0],
            p10_ms: quantile(&s, 0.1),
            p90_ms: quantile(&s, 0.9),
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

/// How [`time_interleaved`] measures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InterleavedOptions {
    /// Untimed rounds first, one launch of every variant each (module loading, clocks, caches).
    pub warmup_rounds: usize,
    /// Least GPU time (ms) one sample should cover: a variant whose launch takes `t` ms runs
    /// `ceil(min_sample_ms / t)` times back to back per sample (at most
    /// [`InterleavedOptions::max_burst`]), so that event resolution and the gap before the first
    /// launch do not matter; a long GEMM runs once per sample.
    pub min_sample_ms: f64,
    /// Most launches in one sample.
    pub max_burst: usize,
    /// Fewest timed rounds.
    pub min_rounds: usize,
    /// Most timed rounds.
    pub max_rounds: usize,
    /// GPU time (ms) all timed rounds together aim at (within `min_rounds..=max_rounds`).
    pub budget_ms: f64,
}

impl Default for InterleavedOptions {
    fn default() -> Self {
        InterleavedOptions {
            warmup_rounds: 1,
            min_sample_ms: 0.2,
            max_burst: 512,
            min_rounds: 10,
            max_rounds: 100,
            budget_ms: 500.0,
        }
    }
}

/// Launches per sample for a variant whose launch takes `estimate_ms`: enough to cover
/// `min_sample_ms`, between 1 and `max_burst` (1 when the estimate is unusable).
pub fn burst_len(estimate_ms: f64, min_sample_ms: f64, max_burst: usize) -> usize {
    let max_burst = max_burst.max(1);
    let usable = |x: f64| x.is_finite() && x > 0.0;
    if !usable(estimate_ms) || !usable(min_sample_ms) {
        return 1;
    }
    let n = (min_sample_ms / estimate_ms).ceil();
    if n >= max_burst as f64 {
        max_burst
    } else {
        (n as usize).max(1)
    }
}

/// Timed rounds for variants whose samples take `sample_ms` each (burst x estimate): as many as
/// fit `budget_ms`, within `min_rounds..=max_rounds` (`max_rounds` is raised to `min_rounds`).
pub fn rounds_for(
    sample_ms: &[f64],
    min_rounds: usize,
    max_rounds: usize,
    budget_ms: f64,
) -> usize {
    let max_rounds = max_rounds.max(min_rounds);
    let per_round: f64 = sample_ms
        .iter()
        .filter(|t| t.is_finite() && **t > 0.0)
        .sum();
    let usable = |x: f64| x.is_finite() && x > 0.0;
    if !usable(per_round) || !usable(budget_ms) {
        return min_rounds;
    }
    let fit = (budget_ms / per_round).floor();
    if fit >= max_rounds as f64 {
        max_rounds
    } else {
        (fit as usize).clamp(min_rounds, max_rounds)
    }
}

/// Nearest-rank quantile `q` of sorted, non-empty `s`.
fn quantile(s: &[f64], q: f64) -> f64 {
    s[((s.len() - 1) as f64 * q).round() as usize]
}

/// How one variant compares with a baseline round by round: statistics of
/// `variant time / baseline time` over the rounds both ran (below 1: the variant was faster).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Paired {
    /// Median ratio.
    pub median: f64,
    /// 10th percentile of the ratios (nearest rank).
    pub p10: f64,
    /// 90th percentile of the ratios (nearest rank; the largest of up to 6 rounds, the second largest of 7 to 16).
    pub p90: f64,
    /// Rounds in which the variant was faster than the baseline.
    pub faster_rounds: usize,
    /// Rounds compared.
    pub rounds: usize,
}

impl Paired {
    /// From per-round times of the baseline and the variant (pairs with a non-finite or
    /// non-positive time are skipped). `None` when no pair is usable.
    pub fn of(baseline: &[f64], variant: &[f64]) -> Option<Paired> {
        let mut r: Vec<f64> = baseline
            .iter()
            .zip(variant)
            .filter(|(b, v)| b.is_finite() && v.is_finite() && **b > 0.0 && **v > 0.0)
            .map(|(b, v)| v / b)
            .collect();
        if r.is_empty() {
            return None;
        }
        r.sort_by(|a, b| a.total_cmp(b));
        Some(Paired {
            median: quantile(&r, 0.5),
            p10: quantile(&r, 0.1),
            p90: quantile(&r, 0.9),
            faster_rounds: r.iter().filter(|x| **x < 1.0).count(),
            rounds: r.len(),
        })
    }
}

impl fmt::Display for Paired {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:.3}x time (p10 {:.3}, p90 {:.3}; faster in {}/{} rounds)",
            self.median, self.p10, self.p90, self.faster_rounds, self.rounds
        )
    }
}

/// What [`time_interleaved`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Interleaved {
    /// Per variant, the time per launch (ms) of each timed round, in round order; empty for a
    /// variant that failed.
    pub samples: Vec<Vec<f64>>,
    /// Per variant, launches per sample.
    pub bursts: Vec<usize>,
    /// Per variant, why it stopped being timed (its first error), if it did.
    pub errors: Vec<Option<String>>,
    /// Timed rounds.
    pub rounds: usize,
    /// Per variant, the host time (ms) its latest launch took to queue.
    pub host_ms: Vec<f64>,
    /// GPU time (ms) of the head starts queued before the samples, all rounds together.
    pub head_start_ms: f64,
    /// Per variant, whether it stopped being timed after the estimate round because it was
    /// over twice the fastest (under a first call's budget); its one sample is the estimate.
    pub pruned: Vec<bool>,
}

impl Interleaved {
    /// Statistics of variant `v`'s per-launch times; `None` if it failed.
    pub fn timing(&self, v: usize) -> Option<Timing> {
        self.samples
            .get(v)
            .and_then(|s| Timing::from_samples(s.clone()))
    }

    /// Variant `v` against variant `base`, round by round; `None` if either failed.
    pub fn paired(&self, base: usize, v: usize) -> Option<Paired> {
        Paired::of(self.samples.get(base)?, self.samples.get(v)?)
    }
}

/// Times `n` variants of a piece of work against each other on the Context's stream (see the
/// module documentation): `f(variant, i)` queues one launch of `variant` on `ctx.stream()`, `i`
/// counting that variant's launches from 0 (to rotate buffers, `i % copies`).
///
/// Steps: `warmup_rounds` untimed rounds; an estimate round (one launch per variant, each between
/// two events, queued behind a first untimed launch so that the GPU is busy when the first event
/// is reached); then the timed rounds, every one of them queued before anything is waited for.
/// When every variant runs once per sample, the estimate round is kept as the first timed
/// round (long GEMMs then cost no extra launch). A variant whose `f` fails is dropped (its error
/// is reported, its samples are discarded); the others go on. Errors of the events themselves
/// are returned.
pub fn time_interleaved(
    ctx: &Context,
    opts: InterleavedOptions,
    n: usize,
    f: impl FnMut(usize, usize) -> Result<()>,
) -> Result<Interleaved> {
    // Candidates run eagerly: capturing each for replay would only cost (`replay::suspended`).
    suspended(|| interleaved(ctx, opts, n, f))
}

fn interleaved(
    ctx: &Context,
    opts: InterleavedOptions,
    n: usize,
    f: impl FnMut(usize, usize) -> Result<()>,
) -> Result<Interleaved> {
    let mut r = Runner::new(f, n);
    r.warm_up(opts.warmup_rounds);
    if opts.warmup_rounds == 0 && n > 0 {
        // Keeps the GPU busy while the estimate round is queued.
        r.run(0, 1);
    }
    let estimate = estimate_round(ctx, &mut r, n)?;
    let Sampling {
        bursts,
        rounds,
        keep_estimate,
    } = Sampling::of(&opts, &r, &estimate);
    let mut samples = r.first_samples(&estimate, rounds, keep_estimate);
    let remaining = if keep_estimate { rounds - 1 } else { rounds };
    if remaining > 0 {
        timed_rounds(ctx, &mut r, &bursts, remaining, &mut samples)?;
    }
    Ok(r.into_interleaved(samples, bursts, rounds))
}

/// How the timed rounds sample, decided from the estimate round's ms per launch of each
/// variant.
struct Sampling {
    /// Launches per sample, per variant.
    bursts: Vec<usize>,
    /// Timed rounds, the estimate round included when it is kept.
    rounds: usize,
    /// Every live variant runs once per sample: the estimate round is the first timed round.
    keep_estimate: bool,
}

impl Sampling {
    fn of<F: FnMut(usize, usize) -> Result<()>>(
        opts: &InterleavedOptions,
        r: &Runner<F>,
        estimate: &[f64],
    ) -> Sampling {
        let n = r.errors.len();
        let bursts: Vec<usize> = estimate
            .iter()
            .map(|&t| burst_len(t, opts.min_sample_ms, opts.max_burst))
            .collect();
        let sample_ms: Vec<f64> = (0..n)
            .filter(|&v| r.alive(v))
            .map(|v| estimate[v] * bursts[v] as f64)
            .collect();
        let rounds = rounds_for(
            &sample_ms,
            opts.min_rounds.max(1),
            opts.max_rounds,
            opts.budget_ms,
        );
        let keep_estimate = (0..n).all(|v| !r.alive(v) || bursts[v] == 1);
        Sampling {
            bursts,
            rounds,
            keep_estimate,
        }
    }
}

/// The variants of [`time_interleaved`] and their state: launches made, first error, host
/// time per launch (ms; the latest burst's, or half the previous estimate if that is larger:
/// a slow outlier fades, a slow variant stays slow).
struct Runner<F> {
    f: F,
    launches: Vec<usize>,
    errors: Vec<Option<String>>,
    host_ms: Vec<f64>,
    /// How many times over a head start covers the variant's host time beyond the usual
    /// margin: doubled (up to [`MAX_COVER`]) after each sample the GPU drained.
    cover: Vec<f64>,
    /// GPU time (ms) of the head starts queued so far.
    head_start_ms: f64,
}

impl<F: FnMut(usize, usize) -> Result<()>> Runner<F> {
    fn new(f: F, n: usize) -> Runner<F> {
        Runner {
            f,
            launches: vec![0usize; n],
            errors: vec![None; n],
            host_ms: vec![0.0; n],
            cover: vec![1.0; n],
            head_start_ms: 0.0,
        }
    }

    /// Runs `count` launches of `v`; false (and the error kept) if one fails or `v` failed
    /// before.
    fn run(&mut self, v: usize, count: usize) -> bool {
        if self.errors[v].is_some() {
            return false;
        }
        let t = std::time::Instant::now();
        for _ in 0..count {
            if let Err(e) = (self.f)(v, self.launches[v]) {
                self.errors[v] = Some(e.to_string());
                return false;
            }
            self.launches[v] += 1;
        }
        if count > 0 {
            let per = t.elapsed().as_secs_f64() * 1e3 / count as f64;
            self.host_ms[v] = per.max(0.5 * self.host_ms[v]);
        }
        true
    }

    fn alive(&self, v: usize) -> bool {
        self.errors[v].is_none()
    }

    /// Forgets the host times learned so far: a warm-up launch that waited for a kernel's
    /// compile or a module's load took hundreds of ms of host time, and the halving memory of
    /// [`Runner::run`] turned that into head starts of as much GPU time for the next rounds
    /// (traced: a training unit's race spent about 1 s of a first call in them).
    fn forget_host_times(&mut self) {
        self.host_ms.iter_mut().for_each(|h| *h = 0.0);
    }

    /// `rounds` untimed rounds of one launch of every variant.
    fn warm_up(&mut self, rounds: usize) {
        for _ in 0..rounds {
            for v in 0..self.errors.len() {
                self.run(v, 1);
            }
        }
    }

    /// Room for `rounds` samples per variant, holding the estimate round of every live variant
    /// where it is kept as the first timed round.
    fn first_samples(&self, estimate: &[f64], rounds: usize, keep_estimate: bool) -> Vec<Vec<f64>> {
        let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds); self.errors.len()];
        if keep_estimate {
            for (v, s) in samples.iter_mut().enumerate() {
                if self.alive(v) {
                    s.push(estimate[v]);
                }
            }
        }
        samples
    }

    /// The measurement, failed variants' samples discarded.
    fn into_interleaved(
        self,
        mut samples: Vec<Vec<f64>>,
        bursts: Vec<usize>,
        rounds: usize,
    ) -> Interleaved {
        for (s, e) in samples.iter_mut().zip(&self.errors) {
            if e.is_some() {
                s.clear();
            }
        }
        let n = self.errors.len();
        Interleaved {
            samples,
            bursts,
            errors: self.errors,
            rounds,
            host_ms: self.host_ms,
            head_start_ms: self.head_start_ms,
            pruned: vec![false; n],
        }
    }
}

fn new_event(ctx: &Context) -> Result<CudaEvent> {
    ctx.cuda()
        .new_event(Some(drv::CUevent_flags::CU_EVENT_DEFAULT))
        .call("cuEventCreate")
}

/// The estimate round: one launch per variant, events in between. Returns each variant's time
/// (ms; NaN for a variant that failed).
fn estimate_round<F: FnMut(usize, usize) -> Result<()>>(
    ctx: &Context,
    r: &mut Runner<F>,
    n: usize,
) -> Result<Vec<f64>> {
    let stream = ctx.stream();
    let mut est_events = Vec::with_capacity(n + 1);
    let first = new_event(ctx)?;
    first.record(stream).call("cuEventRecord")?;
    est_events.push(first);
    let mut est_ok = vec![false; n];
    for (v, ok) in est_ok.iter_mut().enumerate() {
        *ok = r.run(v, 1);
        let e = new_event(ctx)?;
        e.record(stream).call("cuEventRecord")?;
        est_events.push(e);
    }
    if let Some(last) = est_events.last() {
        last.synchronize().call("cuEventSynchronize")?;
    }
    let mut estimate = vec![f64::NAN; n];
    for v in 0..n {
        if est_ok[v] && r.alive(v) {
            estimate[v] = est_events[v]
                .elapsed_ms(&est_events[v + 1])
                .call("cuEventElapsedTime")? as f64;
        }
    }
    Ok(estimate)
}

/// `remaining` timed rounds: a chain of events, one between consecutive samples; all queued,
/// then read. Appends each live variant's time per launch to its samples.
fn timed_rounds<F: FnMut(usize, usize) -> Result<()>>(
    ctx: &Context,
    r: &mut Runner<F>,
    bursts: &[usize],
    remaining: usize,
    samples: &mut [Vec<f64>],
) -> Result<()> {
    let stream = ctx.stream();
    let n = bursts.len();
    if let Some(v0) = (0..n).find(|&v| r.alive(v) && bursts[v] > 1) {
        // Short launches: one untimed burst first, so that the host is ahead of the GPU
        // when the first timed sample starts.
        r.run(v0, bursts[v0]);
    }
    let mut events = Vec::with_capacity(remaining * n + 1);
    let mut spans: Vec<(usize, usize)> = Vec::with_capacity(remaining * n); // (variant, event)
    let e = new_event(ctx)?;
    e.record(stream).call("cuEventRecord")?;
    events.push(e);
    for _ in 0..remaining {
        for (v, &burst) in bursts.iter().enumerate() {
            if !r.alive(v) {
                continue;
            }
            r.run(v, burst);
            let e = new_event(ctx)?;
            e.record(stream).call("cuEventRecord")?;
            events.push(e);
            spans.push((v, events.len() - 2));
        }
    }
    if let Some(last) = events.last() {
        last.synchronize().call("cuEventSynchronize")?;
    }
    for (v, i) in spans {
        let ms = events[i]
            .elapsed_ms(&events[i + 1])
            .call("cuEventElapsedTime")? as f64;
        samples[v].push(ms / bursts[v] as f64);
    }
    Ok(())
}

/// A sample's head start covers this many times its burst's host time ...
const HEAD_START_FACTOR: f64 = 1.5;
/// ... plus this (ms: the events' own queuing, a scheduler hiccup).
const HEAD_START_SLACK_MS: f64 = 0.05;
/// Longest head start (ms): a variant whose burst queues slower than this is timed with the
/// rest of its host time in its samples (none of nnfuse's candidates comes near).
const HEAD_START_MAX_MS: f64 = 200.0;

/// The GPU-side wait of a head start in nanoseconds: `host_ms` of queuing covered
/// [`HEAD_START_FACTOR`] times over plus [`HEAD_START_SLACK_MS`], at most
/// [`HEAD_START_MAX_MS`]. Pure: tested on the CPU.
pub(crate) fn head_start_ns(host_ms: f64) -> u64 {
    let host = if host_ms.is_finite() {
        host_ms.max(0.0)
    } else {
        0.0
    };
    let ms = (host * HEAD_START_FACTOR + HEAD_START_SLACK_MS).min(HEAD_START_MAX_MS);
    (ms * 1e6).round() as u64
}

/// GPU work queued before a sample so that the host queues the whole sample while the GPU is
/// busy: one launch of `timing_spin_ns` (`kernels/timing.cu`), which holds the stream for a
/// given time on the GPU's own clock.
///
/// Why not fills or memsets (what this was before, and what `nnfuse demo` uses with 256 MiB
/// fills): a head start of many short fills costs the host a launch each (a few µs, plus
/// cudarc's event tracking on the buffer) for ~20 µs of GPU work each, so a third or more of it
/// ran on the GPU while the host was still queuing it, and a host-heavy burst then outlasted the
/// rest (measured: a variant with 300 µs of host time per launch timed 52x its GPU time; device
/// memsets did no better). Its size also depended on a calibration of the fill. A spin of a
/// given length is one launch whatever its length, and its length is the GPU's clock.
struct HeadStart {
    spin: CudaFunction,
    /// Cold samples: a buffer written before every head start, as large as the GPU's L2 (or
    /// larger), so that each sample finds its operands in DRAM, not in L2.
    flush: Option<CudaSlice<u8>>,
}

impl HeadStart {
    /// The spin kernel; `None` when it cannot be loaded (the caller then times without head
    /// starts, with a warning).
    fn new(ctx: &Context) -> Option<HeadStart> {
        match ctx.function(&kernels::TIMING, "timing_spin_ns") {
            Ok(spin) => Some(HeadStart { spin, flush: None }),
            Err(e) => {
                tracing::warn!(error = %e,
                    "no head-start kernel: samples are timed without a head start");
                None
            }
        }
    }

    /// Every head start after this first writes `bytes` of scratch (cold samples).
    fn with_flush(mut self, ctx: &Context, bytes: usize) -> Result<HeadStart> {
        self.flush = Some(ctx.stream().alloc_zeros::<u8>(bytes).call("cuMemAlloc")?);
        Ok(self)
    }

    /// Holds the stream long enough for `host_ms` of queuing (with margin), after the flush of
    /// cold samples; returns the head start's length in ms (the flush not counted).
    fn queue(&mut self, ctx: &Context, host_ms: f64) -> Result<f64> {
        if let Some(buf) = self.flush.as_mut() {
            ctx.stream().memset_zeros(buf).call("cuMemsetD8Async")?;
        }
        let ns = head_start_ns(host_ms);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = ctx.stream().launch_builder(&self.spin);
        l.arg(&ns);
        // SAFETY: timing_spin_ns(u64) reads no memory.
        unsafe { l.launch(cfg) }.call("cuLaunchKernel(timing_spin_ns)")?;
        Ok(ns as f64 * 1e-6)
    }
}

/// Diagnostics of the head start on this GPU, for the GPU test that checks it: (the spin
/// kernel's own GPU time for `spin_ms`, the GPU time of `work` queued `host_us` µs of host time
/// after a head start of `spin_ms`), both in ms. The first should be `spin_ms`; the second the
/// work's GPU time alone when `spin_ms` covers `host_us`.
#[doc(hidden)]
pub fn head_start_probe(
    ctx: &Context,
    spin_ms: f64,
    host_us: u64,
    mut work: impl FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    let Some(mut head) = HeadStart::new(ctx) else {
        return Err(crate::error::Error::NotSupported(
            "the head-start kernel did not load".into(),
        ));
    };
    let stream = ctx.stream();
    let (s0, s1, a, b) = (
        new_event(ctx)?,
        new_event(ctx)?,
        new_event(ctx)?,
        new_event(ctx)?,
    );
    ctx.synchronize()?;
    s0.record(stream).call("cuEventRecord")?;
    // head.queue covers `host_ms` 1.5 times plus slack: ask for the spin length itself.
    head.queue(
        ctx,
        (spin_ms - HEAD_START_SLACK_MS).max(0.0) / HEAD_START_FACTOR,
    )?;
    s1.record(stream).call("cuEventRecord")?;
    a.record(stream).call("cuEventRecord")?;
    let t = Instant::now();
    while t.elapsed() < std::time::Duration::from_micros(host_us) {
        std::hint::spin_loop();
    }
    work()?;
    b.record(stream).call("cuEventRecord")?;
    b.synchronize().call("cuEventSynchronize")?;
    let spin = s0.elapsed_ms(&s1).call("cuEventElapsedTime")? as f64;
    let sample = a.elapsed_ms(&b).call("cuEventElapsedTime")? as f64;
    Ok((spin, sample))
}

/// Most times over a head start covers a variant's host time (see [`Runner::cover`]).
const MAX_COVER: f64 = 8.0;

/// One sample of a head-start round: ms per launch, and whether the GPU had already finished
/// the sample's head start when the host finished queuing the burst — it may then have waited
/// for the host inside the sample, which carries host time.
#[derive(Debug, Clone, Copy)]
struct Sample {
    ms: f64,
    drained: bool,
}

/// One round in which every live variant runs one burst between its own pair of events,
/// behind a head start covering the burst's host time; one synchronisation at the end. Returns
/// each variant's sample in this round (`None` for a variant that did not run). A drained
/// sample doubles the variant's cover for the next rounds: its host time grew past what the
/// head start covered (a host-heavy engine's slow call, or another thread's module load holding
/// the context until the GPU drains).
fn head_start_round<F: FnMut(usize, usize) -> Result<()>>(
    ctx: &Context,
    r: &mut Runner<F>,
    head: &mut HeadStart,
    bursts: &[usize],
) -> Result<Vec<Option<Sample>>> {
    let stream = ctx.stream();
    let n = bursts.len();
    let mut spans = Vec::with_capacity(n);
    for (v, &burst) in bursts.iter().enumerate() {
        if !r.alive(v) || burst == 0 {
            continue;
        }
        // Events are made before the head start, so that making them is not queuing time.
        let (a, b) = (new_event(ctx)?, new_event(ctx)?);
        r.head_start_ms += head.queue(ctx, r.cover[v] * r.host_ms[v] * burst as f64)?;
        a.record(stream).call("cuEventRecord")?;
        if !r.run(v, burst) {
            continue;
        }
        // Asked before `b` is recorded: `a` done means the GPU reached the burst's start
        // before the host had queued all of it.
        let drained = a.is_complete();
        b.record(stream).call("cuEventRecord")?;
        if drained {
            r.cover[v] = (2.0 * r.cover[v]).min(MAX_COVER);
            tracing::debug!(
                variant = v,
                burst,
                host_ms = r.host_ms[v],
                cover = r.cover[v],
                "timing: the GPU caught up with the host inside a sample"
            );
        }
        spans.push((v, a, b, drained));
    }
    if let Some((_, _, last, _)) = spans.last() {
        last.synchronize().call("cuEventSynchronize")?;
    }
    let mut out = vec![None; n];
    for (v, a, b, drained) in spans {
        let ms = a.elapsed_ms(&b).call("cuEventElapsedTime")? as f64;
        out[v] = Some(Sample {
            ms: ms / bursts[v] as f64,
            drained,
        });
    }
    Ok(out)
}

/// A variant's timed samples, the drained ones NaN where at least [`MIN_CLEAN`] are not (a
/// drained sample's time includes host time); all of them as measured otherwise (a variant
/// whose calls synchronise drains every sample, and its samples then are what it costs). NaN,
/// not removed: samples pair with the other variants' by round ([`Paired::of`] and
/// [`Timing::from_samples`] skip non-finite ones). Pure.
fn clean_samples(samples: &[Sample]) -> Vec<f64> {
    let clean = samples.iter().filter(|s| !s.drained).count();
    samples
        .iter()
        .map(|s| {
            if s.drained && clean >= MIN_CLEAN {
                f64::NAN
            } else {
                s.ms
            }
        })
        .collect()
}

/// Clean samples a variant needs before its drained ones are dropped.
const MIN_CLEAN: usize = 2;

/// [`time_interleaved`] measuring GPU time only: the same options, rounds and result, but every
/// sample (the estimate's single launches too) is queued behind a head start (a GPU-side wait,
/// one launch) covering 1.5 times the host time its launches took last time, and has its own
/// pair of events, so that the GPU never waits for the host inside a sample. The host time is
/// learned from an untimed first launch of every variant (the warm-up rounds, when asked for,
/// come before it). Falls back to [`time_interleaved`] when the head-start kernel cannot be
/// loaded.
pub fn time_interleaved_gpu(
    ctx: &Context,
    opts: InterleavedOptions,
    n: usize,
    f: impl FnMut(usize, usize) -> Result<()>,
) -> Result<Interleaved> {
    time_interleaved_gpu_until(ctx, opts, n, None, f)
}

/// [`time_interleaved_gpu`] with **cold** samples: one launch per sample, each behind a write
/// of `flush_bytes` of scratch (pass at least the L2's size), so that the operands come from
/// DRAM, as a network's weights do when they are read once per step. For small products
/// whose operands fit in L2: timed warm, back to back, they look faster than they run in a
/// step (H100: the demo's classifier GEMMs 6.6 / 4.7 µs warm, 9.9 / 7.4 µs in the step).
pub fn time_interleaved_gpu_cold(
    ctx: &Context,
    opts: InterleavedOptions,
    n: usize,
    flush_bytes: usize,
    f: impl FnMut(usize, usize) -> Result<()>,
) -> Result<Interleaved> {
    suspended(|| interleaved_gpu_until(ctx, opts, n, None, flush_bytes, f))
}

/// [`time_interleaved_gpu`] that stops adding rounds once `deadline` has passed (host clock)
/// and at least `opts.min_rounds` rounds were timed: the first call's decision budget.
/// [`Interleaved::rounds`] says how many ran.
pub(crate) fn time_interleaved_gpu_until(
    ctx: &Context,
    opts: InterleavedOptions,
    n: usize,
    deadline: Option<Instant>,
    f: impl FnMut(usize, usize) -> Result<()>,
) -> Result<Interleaved> {
    suspended(|| interleaved_gpu_until(ctx, opts, n, deadline, 0, f))
}

fn interleaved_gpu_until(
    ctx: &Context,
    opts: InterleavedOptions,
    n: usize,
    deadline: Option<Instant>,
    flush_bytes: usize,
    f: impl FnMut(usize, usize) -> Result<()>,
) -> Result<Interleaved> {
    let Some(mut head) = HeadStart::new(ctx) else {
        return interleaved(ctx, opts, n, f);
    };
    if flush_bytes > 0 {
        head = head.with_flush(ctx, flush_bytes)?;
    }
    let mut r = Runner::new(f, n);
    r.warm_up(opts.warmup_rounds);
    if opts.warmup_rounds > 0 {
        // The warm-up absorbed the first calls' costs; their host time is not queuing time.
        r.forget_host_times();
    }
    // The host-time probe: one untimed launch of every variant.
    r.warm_up(1);
    let ones = vec![1usize; n];
    let first = head_start_round(ctx, &mut r, &mut head, &ones)?;
    let estimate: Vec<f64> = first.iter().map(|t| t.map_or(f64::NAN, |s| s.ms)).collect();
    let Sampling {
        mut bursts,
        rounds,
        keep_estimate,
    } = Sampling::of(&opts, &r, &estimate);
    if head.flush.is_some() {
        // Cold samples: a burst would find its operands in L2 after its first launch.
        bursts.iter_mut().for_each(|b| *b = (*b).min(1));
    }
    let keep_estimate = keep_estimate || head.flush.is_some();
    let mut samples: Vec<Vec<Sample>> = vec![Vec::with_capacity(rounds); n];
    if keep_estimate {
        for v in (0..n).filter(|&v| r.alive(v)) {
            samples[v].extend(first[v]);
        }
    }
    // Under a deadline (a first call's budget) a variant far slower than the fastest cannot
    // win: its estimate is its only sample and it is not run again. A drained estimate carries
    // host time: it prunes nothing (a host-heavy 160-µs route could otherwise be pruned against
    // a 257-µs one, one way the f32 demo's 3x3 forward could lose `cudnn_dual`).
    let pruned = if deadline.is_some() {
        let usable: Vec<f64> = first
            .iter()
            .map(|t| match t {
                Some(s) if !s.drained => s.ms,
                _ => f64::NAN,
            })
            .collect();
        hopeless(&usable)
    } else {
        vec![false; n]
    };
    let timed: Vec<usize> = (0..n)
        .map(|v| if pruned[v] { 0 } else { bursts[v] })
        .collect();
    for v in (0..n).filter(|&v| pruned[v] && !keep_estimate && r.alive(v)) {
        samples[v].extend(first[v]);
    }
    let mut done = usize::from(keep_estimate);
    while done < rounds && !past(deadline, done, opts.min_rounds) {
        for (v, t) in head_start_round(ctx, &mut r, &mut head, &timed)?
            .into_iter()
            .enumerate()
        {
            samples[v].extend(t);
        }
        done += 1;
    }
    for v in (0..n).filter(|&v| pruned[v]) {
        bursts[v] = 1;
    }
    let samples = samples.iter().map(|s| clean_samples(s)).collect();
    let mut out = r.into_interleaved(samples, bursts, done);
    out.pruned = pruned;
    Ok(out)
}

/// A variant whose estimate is this many times the fastest's is not timed further under a
/// deadline: the incumbent rule asks a challenger to be clearly faster, and a slow incumbent is
/// beaten by the fastest anyway.
pub(crate) const HOPELESS_FACTOR: f64 = 2.0;

/// Which variants (by the estimate round's ms per launch) are [`HOPELESS_FACTOR`] times slower
/// than the fastest: never the incumbent (variant 0, which every challenger is compared with)
/// nor a variant without a usable estimate. Pure: tested on the CPU.
pub(crate) fn hopeless(estimate: &[f64]) -> Vec<bool> {
    let usable = |t: f64| t.is_finite() && t > 0.0;
    let best = estimate
        .iter()
        .copied()
        .filter(|&t| usable(t))
        .fold(f64::INFINITY, f64::min);
    estimate
        .iter()
        .enumerate()
        .map(|(v, &t)| v > 0 && usable(t) && t > HOPELESS_FACTOR * best)
        .collect()
}

/// Whether timing stops before another round: the deadline has passed and `done` rounds
/// reach `min_rounds`. Pure.
fn past(deadline: Option<Instant>, done: usize, min_rounds: usize) -> bool {
    done >= min_rounds.max(1) && deadline.is_some_and(|d| Instant::now() >= d)
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
    fn a_slow_warm_up_launch_leaves_no_host_time_behind() {
        // Variant 0's first launch stands for one that waited for a compile.
        let mut first = true;
        let mut r = Runner::new(
            |_v: usize, _k: usize| {
                if std::mem::take(&mut first) {
                    std::thread::sleep(std::time::Duration::from_millis(30));
                }
                Ok(())
            },
            2,
        );
        r.warm_up(1);
        assert!(r.host_ms[0] >= 25.0, "{:?}", r.host_ms);
        r.forget_host_times();
        r.warm_up(1);
        assert!(r.host_ms.iter().all(|&h| h < 5.0), "{:?}", r.host_ms);
    }

    #[test]
    fn only_clearly_slower_challengers_are_hopeless() {
        assert_eq!(hopeless(&[1.0, 1.7, 2.1, 0.9]), [false, false, true, false]);
        // The incumbent stays even when it is the slowest.
        assert_eq!(hopeless(&[9.0, 1.0, 1.5]), [false, false, false]);
        // Unusable estimates are never pruned, nor do they set the best.
        assert_eq!(
            hopeless(&[f64::NAN, 1.0, 0.0, 3.0]),
            [false, false, false, true]
        );
        assert_eq!(hopeless(&[]), Vec::<bool>::new());
        assert_eq!(hopeless(&[f64::NAN, f64::INFINITY]), [false, false]);
    }

    #[test]
    fn bursts_cover_the_minimum_sample() {
        assert_eq!(burst_len(0.012, 0.2, 512), 17);
        assert_eq!(burst_len(3.0, 0.2, 512), 1);
        assert_eq!(burst_len(0.2, 0.2, 512), 1);
        assert_eq!(burst_len(1e-6, 0.2, 512), 512);
        assert_eq!(burst_len(f64::NAN, 0.2, 512), 1);
        assert_eq!(burst_len(0.0, 0.2, 512), 1);
        assert_eq!(burst_len(0.01, 0.2, 0), 1);
    }

    #[test]
    fn rounds_fit_the_budget() {
        // 9 samples of 3 ms = 27 ms a round: 80 ms fits 2, raised to the minimum of 3.
        assert_eq!(rounds_for(&[3.0; 9], 3, 11, 80.0), 3);
        // 1 ms a round: 80 fit, capped at 11.
        assert_eq!(rounds_for(&[0.1; 10], 3, 11, 80.0), 11);
        assert_eq!(rounds_for(&[2.0, 2.0], 3, 11, 20.0), 5);
        assert_eq!(rounds_for(&[], 3, 11, 20.0), 3);
        assert_eq!(rounds_for(&[f64::NAN], 4, 11, 20.0), 4);
        assert_eq!(rounds_for(&[1.0], 5, 2, 100.0), 5);
    }

    #[test]
    fn paired_ratios_cancel_common_drift() {
        // The baseline drifts from 1.0 to 1.5 ms; the variant is 3 % faster in every round.
        let base = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5];
        let var: Vec<f64> = base.iter().map(|b| b * 0.97).collect();
        let p = Paired::of(&base, &var).unwrap();
        assert!((p.median - 0.97).abs() < 1e-12);
        assert!((p.p90 - 0.97).abs() < 1e-12);
        assert_eq!(p.faster_rounds, 6);
        assert_eq!(p.rounds, 6);
        // Pairs with an unusable time are skipped.
        let skip = Paired::of(&[1.0, f64::NAN, 2.0], &[2.0, 1.0, 1.0]).unwrap();
        assert_eq!(skip.rounds, 2);
        assert!(Paired::of(&[], &[]).is_none());
        // The 90th percentile is the largest ratio up to 6 rounds, the second largest from 7.
        let six = Paired::of(&[1.0; 6], &[0.9, 0.9, 0.9, 0.9, 0.9, 1.1]).unwrap();
        assert_eq!(six.p90, 1.1);
        let seven = Paired::of(&[1.0; 7], &[0.9, 0.9, 0.9, 0.9, 0.9, 0.95, 1.1]).unwrap();
        assert_eq!(seven.p90, 0.95);
        let sixteen = Paired::of(&[1.0; 16], &[[0.9; 15].as_slice(), &[1.1]].concat()).unwrap();
        assert_eq!(sixteen.p90, 0.9);
        assert!(Paired::of(&[0.0], &[1.0]).is_none());
    }

    #[test]
    fn head_starts_cover_the_host_time_with_margin() {
        assert_eq!(head_start_ns(0.0), 50_000);
        assert_eq!(head_start_ns(10.2), 15_350_000);
        assert_eq!(head_start_ns(f64::NAN), 50_000);
        assert_eq!(head_start_ns(-1.0), 50_000);
        assert_eq!(head_start_ns(1e9), 200_000_000);
    }

    #[test]
    fn drained_samples_are_dropped_only_where_enough_clean_ones_remain() {
        let s = |ms: f64, drained: bool| Sample { ms, drained };
        let c = clean_samples(&[s(9.0, true), s(1.0, false), s(1.1, false), s(7.0, true)]);
        // Dropped as NaN, so that round k still pairs with the other variants' round k.
        assert_eq!(c.len(), 4);
        assert!(c[0].is_nan() && c[3].is_nan());
        assert_eq!(&c[1..3], &[1.0, 1.1]);
        let t = Timing::from_samples(c.clone()).unwrap();
        assert_eq!((t.iters, t.min_ms), (2, 1.0));
        let p = Paired::of(&[1.0, 1.0, 2.0, 1.0], &c).unwrap();
        // Rounds 1 and 2 only: 1.0 / 1.0 and 1.1 / 2.0.
        assert_eq!((p.rounds, p.faster_rounds), (2, 1), "{p:?}");
        assert!((p.p10 - 0.55).abs() < 1e-12, "{p:?}");
        // One clean sample is not enough to judge by: every sample stays.
        assert_eq!(clean_samples(&[s(9.0, true), s(1.0, false)]), [9.0, 1.0]);
        // A variant whose calls synchronise drains every sample: those are what it costs.
        assert_eq!(clean_samples(&[s(3.0, true), s(3.1, true)]), [3.0, 3.1]);
        assert!(clean_samples(&[]).is_empty());
    }

    #[test]
    fn timing_stops_at_the_deadline_after_the_minimum_rounds() {
        let gone = Some(Instant::now());
        let later = Some(Instant::now() + std::time::Duration::from_secs(3600));
        assert!(!past(None, 50, 3));
        assert!(!past(gone, 2, 3));
        assert!(past(gone, 3, 3));
        assert!(!past(later, 10, 3));
        assert!(!past(gone, 0, 0));
        assert!(past(gone, 1, 0));
    }

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
