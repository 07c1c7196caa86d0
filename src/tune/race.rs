//! The timing step of a measurement: the candidates that passed their check take turns
//! ([`crate::timing::time_interleaved`], the incumbent as variant 0), and the winner is decided
//! by the incumbent rule ([`super::rule::best_challenger`]).

use super::rule::best_challenger;
use crate::context::Context;
use crate::error::Result;
use std::time::Instant;

use crate::timing::{
    time_interleaved, time_interleaved_gpu_until, Interleaved, InterleavedOptions,
};

/// What [`race`] measured and decided.
pub(crate) struct Race {
    /// The interleaved timing (variant 0 is the incumbent).
    pub timing: Interleaved,
    /// The variant that beats the incumbent by the rule, with its median ratio; `None` keeps the
    /// incumbent. A variant that failed while timed never wins.
    pub challenger: Option<(usize, f64)>,
}

/// Times `n` variants (`launch(variant, i)` queues one launch on `ctx.stream()`, variant 0 being
/// the incumbent) and decides whether a challenger replaces the incumbent.
pub(crate) fn race(
    ctx: &Context,
    opts: InterleavedOptions,
    n: usize,
    launch: impl FnMut(usize, usize) -> Result<()>,
) -> Result<Race> {
    ctx.refuse_under_capture("a measurement", "time candidates (events, synchronisation)")?;
    decided(time_interleaved(ctx, opts, n, launch)?)
}

/// [`race`] measuring GPU time only ([`crate::timing::time_interleaved_gpu`]: every sample queued behind a
/// head start of GPU work that covers its host time), for candidates whose calls can queue
/// slower than the GPU runs them (legacy cuDNN: 60-100 us of host time per call).
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

/// The incumbent rule on a timing.
fn decided(timing: Interleaved) -> Result<Race> {
    let n = timing.samples.len();
    let challenger = best_challenger(
        (1..n)
            .filter(|&v| timing.errors[v].is_none())
            .map(|v| (v, timing.paired(0, v))),
    );
    Ok(Race { timing, challenger })
}

/// Milliseconds since `t` (host wall time of a measurement's phases).
pub(crate) fn ms_since(t: std::time::Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}
