//! The first call of a [`ConvBnTrain`]: the unfused route into the caller's buffers (the
//! result and the reference), the fused route into NaN-poisoned buffers of its own checked
//! against it on the device, then both timed — forward plus the BatchNorm's backward, GPU
//! time, interleaved rounds behind a head start — and the incumbent rule.

use cudarc::driver::CudaSlice;

use super::api::lock;
use super::check::{passes, tolerance};
use super::train::{ConvBnArgs, ConvBnTrain, TrainChoice, TrainSaved};
use super::train_plan::TrainRoute;
use crate::batchnorm::{BackwardArgs, Fuse};
use crate::device_check::compare_on_device;
use crate::dtype::Element;
use crate::error::{CallExt, Result};
use crate::timing::{time_interleaved_gpu, Interleaved, InterleavedOptions};
use crate::tune::budget::NOT_COMPILED;
use crate::tune::rule::best_challenger;

/// The race's options (the unit's forward and backward decisions): a first call's budget, not
/// a benchmark's.
pub(super) const RACE: InterleavedOptions = InterleavedOptions {
    warmup_rounds: 1,
    min_sample_ms: 0.2,
    max_burst: 16,
    min_rounds: 6,
    max_rounds: 20,
    budget_ms: 40.0,
};

/// The measurement's own buffers: the forward's outputs and running statistics, and the
/// backward's outputs.
struct Probe<T> {
    z: CudaSlice<T>,
    y: CudaSlice<T>,
    rm: CudaSlice<f32>,
    rv: CudaSlice<f32>,
    dz: CudaSlice<T>,
    d_addend: Option<CudaSlice<T>>,
    dgamma: CudaSlice<f32>,
    dbeta: CudaSlice<f32>,
}

impl<T: Element> ConvBnTrain<T> {
    /// Decides the route on this call's operands (see the type's documentation); the caller's
    /// buffers receive the unfused route's result and its running statistics move once.
    pub(super) fn decide(&self, a: &mut ConvBnArgs<'_, T>) -> Result<TrainSaved> {
        self.ctx.refuse_under_capture(
            "the first call of a conv+BN training unit",
            "measure the routes (make the first call outside capture)",
        )?;
        let s = self.ctx.stream();
        let c = a.gamma.len();
        // The running statistics before the call: the fused route's check starts from them.
        let rm0 = s.clone_dtoh(&a.running_mean).call("cuMemcpyDtoH")?;
        let rv0 = s.clone_dtoh(&a.running_var).call("cuMemcpyDtoH")?;
        let saved = self.run(TrainRoute::Unfused, a)?;
        let mut notes = Vec::new();
        if !self.plan.eligible(TrainRoute::Fused) {
            notes.push(format!(
                "fused: refused by the plan: {}",
                self.plan.reason(TrainRoute::Fused)
            ));
            self.record(TrainRoute::Unfused, Vec::new(), notes, false);
            return Ok(saved);
        }
        if !self.fused_kernels_ready() && self.ctx.config().conv_tune_budget_ms > 0 {
            // Under the first call's budget (NNFUSE_CONV_TUNE_BUDGET_MS) a compile is not
            // waited for: a traced cold first step spent 0.2-0.9 s per unit in such waits.
            notes.push(format!(
                "fused: not measured yet: {NOT_COMPILED}; the first forward_train after they \
                 are ready measures it"
            ));
            self.record(TrainRoute::Unfused, Vec::new(), notes, true);
            return Ok(saved);
        }
        let n = a.z.len();
        let alloc = |len: usize| -> Result<CudaSlice<T>> {
            // SAFETY: every user below writes these (poisoned first where checked) before reading.
            unsafe { s.alloc::<T>(len.max(1)) }.call("cuMemAllocAsync")
        };
        let mut p = Probe {
            z: alloc(n)?,
            y: alloc(n)?,
            rm: s.clone_htod(&rm0).call("cuMemcpyHtoD")?,
            rv: s.clone_htod(&rv0).call("cuMemcpyHtoD")?,
            dz: alloc(n)?,
            d_addend: match self.plan.fuse {
                Fuse::AddRelu => Some(alloc(n)?),
                _ => None,
            },
            dgamma: s.alloc_zeros::<f32>(c.max(1)).call("cuMemAllocAsync")?,
            dbeta: s.alloc_zeros::<f32>(c.max(1)).call("cuMemAllocAsync")?,
        };
        match self.check_fused(a, &mut p) {
            Ok(line) => notes.push(format!("fused: matches unfused: {line}")),
            Err(why) => {
                notes.push(format!("fused: not taken: {why}"));
                self.record(TrainRoute::Unfused, Vec::new(), notes, false);
                return Ok(saved);
            }
        }
        let (times, fused_wins) = self.race(a, &mut p, &mut notes)?;
        let route = if fused_wins {
            TrainRoute::Fused
        } else {
            TrainRoute::Unfused
        };
        self.record(route, times, notes, false);
        Ok(saved)
    }

    /// Runs the fused route into the poisoned probe from the call's starting running
    /// statistics and compares y (on the device) and the running statistics (host, one per
    /// channel) with the unfused route's: a line saying what passed, or why not.
    fn check_fused(
        &self,
        a: &mut ConvBnArgs<'_, T>,
        p: &mut Probe<T>,
    ) -> std::result::Result<String, String> {
        let dt = T::DTYPE;
        let tol = tolerance(dt);
        let ((rel, bad), rm_err, rv_err) = (|| -> Result<((f64, f64), f64, f64)> {
            crate::util::fill(&self.ctx, &mut p.z, T::from_f64(f64::NAN))?;
            crate::util::fill(&self.ctx, &mut p.y, T::from_f64(f64::NAN))?;
            let s = self.ctx.stream();
            let saved = self.run(TrainRoute::Fused, &mut probe_args(a, p))?;
            drop(saved);
            let verdict = compare_on_device(&self.ctx, &a.y, &p.y, "the unfused output")?;
            let want_rm = s.clone_dtoh(&a.running_mean).call("cuMemcpyDtoH")?;
            let want_rv = s.clone_dtoh(&a.running_var).call("cuMemcpyDtoH")?;
            let got_rm = s.clone_dtoh(&p.rm).call("cuMemcpyDtoH")?;
            let got_rv = s.clone_dtoh(&p.rv).call("cuMemcpyDtoH")?;
            Ok((
                verdict,
                rel_l2(&want_rm, &got_rm),
                rel_l2(&want_rv, &got_rv),
            ))
        })()
        .map_err(|e| format!("it failed: {e}"))?;
        let line = format!(
            "y relative L2 {rel:.2e} ({bad} non-finite), running mean {rm_err:.2e}, running \
             variance {rv_err:.2e} (bound {tol:.0e})"
        );
        // The running statistics are f32 in both routes: the f32 bound at most, or the type's
        // for halves (the statistics come from the rounded z).
        if passes(rel, bad, dt) && rm_err <= tol && rv_err <= tol {
            Ok(line)
        } else {
            Err(format!("it differs from unfused: {line}"))
        }
    }

    /// Times the unfused route (variant 0) and the fused one, each a forward and the
    /// BatchNorm's backward on the probe (dy: the caller's y), against each other: the medians,
    /// and whether the fused route beats the incumbent by the crate's rule.
    fn race(
        &self,
        a: &mut ConvBnArgs<'_, T>,
        p: &mut Probe<T>,
        notes: &mut Vec<String>,
    ) -> Result<(Vec<(TrainRoute, f64)>, bool)> {
        const ROUTES: [TrainRoute; 2] = [TrainRoute::Unfused, TrainRoute::Fused];
        let timed = time_interleaved_gpu(&self.ctx, RACE, 2, |v, _| {
            let route = ROUTES[v];
            let saved = self.run(route, &mut probe_args(a, p))?;
            self.backward_bn(BackwardArgs {
                x: p.z.as_view(),
                y: p.y.as_view(),
                dy: a.y.slice(..),
                gamma: a.gamma.slice(..),
                beta: a.beta.slice(..),
                saved: &saved.bn,
                dx: p.dz.as_view_mut(),
                d_addend: p.d_addend.as_mut().map(|d| d.as_view_mut()),
                dgamma: p.dgamma.as_view_mut(),
                dbeta: p.dbeta.as_view_mut(),
            })
        })?;
        Ok(two_way_verdict(&timed, ROUTES, ["unfused", "fused"], notes))
    }

    /// Stores the decision (`provisional`: made without the fused route's measurement).
    fn record(
        &self,
        route: TrainRoute,
        times_us: Vec<(TrainRoute, f64)>,
        notes: Vec<String>,
        provisional: bool,
    ) {
        let stats = self.fused.as_ref().and_then(|f| f.stats.choice());
        tracing::info!(%route, ?times_us, ?notes, provisional, "conv+BN training unit decided");
        *lock(&self.decision) = Some(TrainChoice {
            route,
            times_us,
            stats,
            notes,
            provisional,
        });
    }
}

/// A two-way race's outcome (variant 0 the incumbent, 1 the challenger; `labels` their names
/// in the notes): each timed variant's median as `(ids[v], µs)`, and whether the challenger
/// beats the incumbent by the crate's rule, with one note saying so or why it was not timed.
pub(super) fn two_way_verdict<I: Copy>(
    timed: &Interleaved,
    ids: [I; 2],
    [incumbent, challenger]: [&str; 2],
    notes: &mut Vec<String>,
) -> (Vec<(I, f64)>, bool) {
    let times = (0..2)
        .filter_map(|v| timed.timing(v).map(|t| (ids[v], t.median_us())))
        .collect();
    let mut wins = false;
    if let Some(e) = &timed.errors[1] {
        notes.push(format!("{challenger}: failed while timed: {e}"));
    } else if let Some(pd) = timed.paired(0, 1) {
        wins = best_challenger([(1, Some(pd))]).is_some();
        let verdict = if wins { "beats" } else { "does not beat" };
        notes.push(format!("{challenger}: {verdict} {incumbent}: {pd}"));
    }
    (times, wins)
}

/// The caller's inputs with the probe's outputs and running statistics.
fn probe_args<'s, T>(a: &'s ConvBnArgs<'_, T>, p: &'s mut Probe<T>) -> ConvBnArgs<'s, T> {
    ConvBnArgs {
        x: a.x.slice(..),
        w: a.w.slice(..),
        z: p.z.as_view_mut(),
        addend: a.addend.as_ref().map(|v| v.slice(..)),
        gamma: a.gamma.slice(..),
        beta: a.beta.slice(..),
        running_mean: p.rm.as_view_mut(),
        running_var: p.rv.as_view_mut(),
        y: p.y.as_view_mut(),
        momentum: a.momentum,
        eps: a.eps,
    }
}

/// `||got - want|| / ||want||` (0 for two zero vectors; infinite for a length mismatch or a
/// non-finite value).
pub(super) fn rel_l2(want: &[f32], got: &[f32]) -> f64 {
    if want.len() != got.len() {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (w, g) in want.iter().zip(got) {
        let (w, g) = (f64::from(*w), f64::from(*g));
        if !w.is_finite() || !g.is_finite() {
            return f64::INFINITY;
        }
        num += (g - w) * (g - w);
        den += w * w;
    }
    if den > 0.0 {
        (num / den).sqrt()
    } else if num == 0.0 {
        0.0
    } else {
        f64::INFINITY
    }
}

#[cfg(test)]
mod tests {
    use super::rel_l2;

    #[test]
    fn relative_l2_of_equal_close_and_broken_vectors() {
        assert_eq!(rel_l2(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert_eq!(rel_l2(&[0.0; 3], &[0.0; 3]), 0.0);
        let e = rel_l2(&[3.0, 4.0], &[3.0, 4.5]);
        assert!((e - 0.1).abs() < 1e-12, "{e}");
        assert!(rel_l2(&[1.0], &[f32::NAN]).is_infinite());
        assert!(rel_l2(&[1.0], &[1.0, 2.0]).is_infinite());
        assert!(rel_l2(&[0.0], &[1.0]).is_infinite());
    }
}
