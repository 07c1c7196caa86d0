//! The timing step of a measurement: the candidates that passed their check take turns
//! ([`crate::timing::time_interleaved`] or its GPU-time-only forms, the incumbent as variant 0), and the winner is decided
//! by the incumbent rule ([`super::rule::best_challenger`]).

use super::rule::best_challenger;
use crate::context::Context;
use crate::error::Result;
use std::time::Instant;

use crate::timing::{
    time_interleaved, time_interleaved_gpu_cold, time_interleaved_gpu_until, Interleaved,
    InterleavedOptions,
};

/// What a race measured and decided.
pub(crate) struct Race {
    /// The interleaved timing (variant 0 is the incumbent).
    pub timing: Interleaved,
    /// The variant that beats the incumbent by the rule, with its median ratio; `None` keeps the
    /// incumbent. A variant that failed while timed never wins.
    pub challenger: Option<(usize, f64)>,
}

/// Times `n` variants (`launch(variant, i)` queues one launch on `ctx.stream()`, variant 0 being
/// the incumbent), each sample a burst of back-to-back launches
/// ([`crate::timing::time_interleaved`]: the host's pace counts when it is slower than the
/// GPU's), and decides whether a challenger replaces the incumbent.
pub(crate) fn race(
    ctx: &Context,
    opts: InterleavedOptions,
    n: usize,
    launch: impl FnMut(usize, usize) -> Result<()>,
) -> Result<Race> {
    ctx.refuse_under_capture("a measurement", "time candidates (events, synchronisation)")?;
    decided(time_interleaved(ctx, opts, n, launch)?)
}

/// Times `n` variants (`launch(variant, i)` queues one launch on `ctx.stream()`, variant 0 being
/// the incumbent) measuring GPU time only ([`crate::timing::time_interleaved_gpu`]: every sample
/// queued behind a head start of GPU work that covers its host time), so that a call that queues
/// slower than the GPU runs it (legacy cuDNN: 60-100 us of host time; a small GEMM: 10-17 us) is
/// judged by its GPU time, and decides whether a challenger replaces the incumbent.
/// No round starts after `deadline` (the first call's decision budget) once `opts.min_rounds`
/// were timed.
pub(crate) fn race_gpu(
    ctx: &Context,
    opts: InterleavedOptions,
    n: usize,
    deadline: Option<Instant>,
    launch: impl FnMut(usize, usize) -> Result<()>,
) -> Result<Race> {
    ctx.refuse_under_capture("a measurement", "time candidates (events, synchronisation)")?;
    decided(time_interleaved_gpu_until(ctx, opts, n, deadline, launch)?)
}

/// [`race_gpu`] with cold samples ([`crate::timing::time_interleaved_gpu_cold`]: one launch per
/// sample behind a write of `flush_bytes` of scratch), for candidates whose operands fit in L2.
pub(crate) fn race_gpu_cold(
    ctx: &Context,
    opts: InterleavedOptions,
    n: usize,
    flush_bytes: usize,
    launch: impl FnMut(usize, usize) -> Result<()>,
) -> Result<Race> {
    ctx.refuse_under_capture("a measurement", "time candidates (events, synchronisation)")?;
    decided(time_interleaved_gpu_cold(
        ctx,
        opts,
        n,
        flush_bytes,
        launch,
    )?)
}

/// The incumbent rule on a timing. A variant pruned after its estimate (over twice the fastest
/// under a deadline) is no challenger: its one sample, paired with the incumbent's first round,
/// once made a 77 µs engine "beat" a 35 µs incumbent whose first round ran at 91 µs (H100, f32
/// 8x8/4 filter gradient).
fn decided(timing: Interleaved) -> Result<Race> {
    let n = timing.samples.len();
    let challenger = best_challenger(
        (1..n)
            .filter(|&v| {
                timing.errors[v].is_none() && !timing.pruned.get(v).copied().unwrap_or(false)
            })
            .map(|v| (v, timing.paired(0, v))),
    );
    Ok(Race { timing, challenger })
}

/// Milliseconds since `t` (host wall time of a measurement's phases).
pub(crate) fn ms_since(t: std::time::Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(samples: Vec<Vec<f64>>, pruned: Vec<bool>) -> Interleaved {
        let n = samples.len();
        Interleaved {
            samples,
            bursts: vec![1; n],
            errors: vec![None; n],
            rounds: 3,
            host_ms: vec![0.0; n],
            head_start_ms: 0.0,
            pruned,
        }
    }

    /// A pruned variant's single sample cannot replace the incumbent, even when it pairs with
    /// the incumbent's slow first round; a variant timed every round still can.
    #[test]
    fn a_pruned_variant_is_no_challenger() {
        let inc = vec![0.0907, 0.0352, 0.0350];
        let r = decided(timing(vec![inc.clone(), vec![0.0773]], vec![false, true])).unwrap();
        assert_eq!(r.challenger, None);
        // Not pruned, the same lone sample would have won (the defect this guards against).
        let r = decided(timing(vec![inc.clone(), vec![0.0773]], vec![false, false])).unwrap();
        assert_eq!(r.challenger.map(|c| c.0), Some(1));
        // A variant faster in every round wins, next to a pruned one.
        let fast = vec![0.0300, 0.0300, 0.0301];
        let r = decided(timing(
            vec![inc, vec![0.0773], fast],
            vec![false, true, false],
        ))
        .unwrap();
        assert_eq!(r.challenger.map(|c| c.0), Some(2));
    }
}
