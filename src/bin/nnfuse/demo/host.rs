//! The host's time to queue a step while the GPU is busy, and `--profile-host`'s profiled pass:
//! each step queued behind a head start, with an event after the head start whose state once
//! the step is queued says whether the GPU was still busy throughout.
//!
//! Why busy: a call queued on an idle GPU pays for waking the GPU's queue (a cuDNN convolution
//! queued right after a synchronize measured 19 µs of host time on the H100 against 12.6 µs with
//! the GPU busy), and a training loop keeps the GPU busy.

use std::time::Instant;

use anyhow::Result;
use cudarc::driver::CudaEvent;
use nnfuse::internals::profile::{self, Totals};
use nnfuse::{Context, Element};

use super::block::STEP;
use super::gpu::{new_event, run_step, Buffers, HeadStart, Layers};
use super::host_profile::{add_totals, HostProfile};

/// Times after which a head start the GPU outran is doubled and the sample taken again.
const RETRIES: usize = 2;

/// A head start and the event recorded after it.
pub struct BusyGpu {
    head: HeadStart,
    done: CudaEvent,
}

/// One sample: host time (ms), whether the GPU was still busy with the head start once the
/// queueing returned, and what the queueing returned.
pub struct Sample<R> {
    /// Host time of the queueing (ms).
    pub ms: f64,
    /// The head start's event had not completed when the queueing returned.
    pub busy: bool,
    /// The queueing's own result.
    pub value: R,
}

impl BusyGpu {
    /// A head start covering `host_ms` of queueing twice over (plus 0.5 ms; see
    /// [`HeadStart::new`]).
    pub fn new(ctx: &Context, host_ms: f64) -> Result<Self> {
        Ok(BusyGpu {
            head: HeadStart::new(ctx, host_ms)?,
            done: new_event(ctx)?,
        })
    }

    /// Waits for the GPU, queues the head start and its event, then runs `queue` timed by the
    /// wall clock. When the event has completed by the time `queue` returns (the GPU caught up),
    /// doubles the head start and tries again, at most [`RETRIES`] times; the last try's sample
    /// says whether the GPU stayed busy.
    pub fn sample<R>(
        &mut self,
        ctx: &Context,
        mut queue: impl FnMut() -> Result<R>,
    ) -> Result<Sample<R>> {
        let mut tries = 0;
        loop {
            ctx.synchronize()?;
            self.head.queue(ctx)?;
            self.done.record(ctx.stream())?;
            let t = Instant::now();
            let value = queue()?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let busy = !self.done.try_is_complete()?;
            if busy || tries == RETRIES {
                ctx.synchronize()?;
                return Ok(Sample { ms, busy, value });
            }
            tries += 1;
            self.head.fills = (self.head.fills * 2).min(HeadStart::MAX_FILLS);
        }
    }
}

/// Host time (ms) to queue one step of `l` while the GPU is busy, and whether it stayed busy.
pub fn busy_step_ms<T: Element>(
    busy: &mut BusyGpu,
    l: &Layers<T>,
    b: &mut Buffers<T>,
) -> Result<(f64, bool)> {
    let s = busy.sample(&l.ctx, || run_step(l, b, &mut |_| Ok(())))?;
    Ok((s.ms, s.busy))
}

/// `--profile-host`: `steps` steps of `l` queued while the GPU is busy with the library's stage
/// profiler on (restored to what it was after), each operation's call timed around it and its
/// stages taken apart.
pub fn profile_steps<T: Element>(
    busy: &mut BusyGpu,
    l: &Layers<T>,
    b: &mut Buffers<T>,
    steps: usize,
) -> Result<HostProfile> {
    let was = profile::enabled();
    profile::set_enabled(true);
    let result = profiled(busy, l, b, steps);
    profile::set_enabled(was);
    result
}

fn profiled<T: Element>(
    busy: &mut BusyGpu,
    l: &Layers<T>,
    b: &mut Buffers<T>,
    steps: usize,
) -> Result<HostProfile> {
    let mut p = HostProfile::new();
    for _ in 0..steps {
        let s = busy.sample(&l.ctx, || {
            let mut ops: Vec<(f64, Totals)> = Vec::with_capacity(STEP.len());
            // What the head start's calls left in the profiler is not the step's.
            let _ = profile::take();
            let mut last = Instant::now();
            run_step(l, b, &mut |_| {
                let wall = last.elapsed().as_secs_f64() * 1e3;
                ops.push((wall, profile::take()));
                last = Instant::now();
                Ok(())
            })?;
            Ok(ops)
        })?;
        if !s.busy {
            p.gpu_went_idle += 1;
        }
        for (o, (wall, t)) in p.ops.iter_mut().zip(s.value) {
            o.wall_ms.push(wall);
            add_totals(&mut o.stages, &t);
        }
    }
    Ok(p)
}
