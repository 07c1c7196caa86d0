//! The first call of a (shortcut, ReLU) combination: the unfused composition into `y` (the
//! reference), every eligible fused route checked against it, those that pass timed against it
//! (GPU time, interleaved rounds behind a head start), and the incumbent rule.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr};

use super::api::{lock, slot, BlockChoice, ConvBnInference};
use super::check::passes;
use super::plan::BlockRoute;
use super::routes::ensure;
use crate::device_check::DeviceCompare;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::timing::{time_interleaved_gpu, InterleavedOptions};
use crate::tune::rule::best_challenger;

/// The race's options: a first call's budget, not a benchmark's.
const RACE: InterleavedOptions = InterleavedOptions {
    warmup_rounds: 1,
    min_sample_ms: 0.2,
    max_burst: 64,
    min_rounds: 6,
    max_rounds: 20,
    budget_ms: 60.0,
};

impl<T: Element> ConvBnInference<T> {
    /// Decides the route of (shortcut, relu) on this call's operands (see the type's
    /// documentation); `y` receives the unfused composition's result.
    pub(super) fn decide(
        &self,
        x: &CudaView<'_, T>,
        shortcut: Option<&CudaView<'_, T>>,
        relu: bool,
        y: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        self.ctx.refuse_under_capture(
            "the first call of a conv+BN inference combination",
            "measure the routes (make the first call outside capture)",
        )?;
        self.run_unfused(x, shortcut, relu, y)?;
        let candidates = self.plan.fused_candidates();
        let mut notes = Vec::new();
        let mut passed = Vec::new();
        if !candidates.is_empty() {
            let y_len = y.len();
            let y_ptr = y.device_ptr(self.ctx.stream()).0;
            // SAFETY: y holds y_len elements of T on the Context's device (validated), written
            // by the unfused composition above on this stream.
            let mut reference = unsafe { DeviceCompare::new(&self.ctx, T::DTYPE, y_ptr, y_len) }?;
            let bad = reference.reference_nonfinite();
            if bad != 0.0 {
                notes.push(format!(
                    "fused routes not checked: the unfused output has {bad} non-finite elements \
                     on this call's data"
                ));
                self.record(
                    shortcut.is_some(),
                    relu,
                    BlockRoute::Unfused,
                    Vec::new(),
                    notes,
                );
                return Ok(());
            }
            let mut probe = {
                let mut bufs = lock(&self.buffers);
                ensure(
                    &self.ctx,
                    &mut bufs.probe,
                    y_len,
                    "the measurement's output",
                )?;
                bufs.probe
                    .take()
                    .ok_or_else(|| Error::NotSupported("probe buffer missing".into()))?
            };
            for r in candidates {
                match self.check_route(r, x, shortcut, relu, &mut reference, &mut probe) {
                    Ok(line) => {
                        notes.push(line);
                        passed.push(r);
                        if r == BlockRoute::GemmEpilogue {
                            let line = self.choose_gemm_algo(
                                x,
                                shortcut,
                                relu,
                                &mut reference,
                                &mut probe,
                            )?;
                            notes.push(line);
                        }
                    }
                    Err(why) => notes.push(format!("{r}: dropped: {why}")),
                }
            }
            if !passed.is_empty() {
                let (route, times_us) =
                    self.race(&passed, x, shortcut, relu, y, &mut probe, &mut notes)?;
                self.record(shortcut.is_some(), relu, route, times_us, notes);
                return Ok(());
            }
        }
        self.record(
            shortcut.is_some(),
            relu,
            BlockRoute::Unfused,
            Vec::new(),
            notes,
        );
        Ok(())
    }

    /// Stores the decision of (shortcut, relu).
    fn record(
        &self,
        shortcut: bool,
        relu: bool,
        route: BlockRoute,
        times_us: Vec<(BlockRoute, f64)>,
        notes: Vec<String>,
    ) {
        tracing::info!(%route, ?times_us, ?notes, shortcut, relu,
            "conv+BN inference route decided");
        lock(&self.decisions)[slot(shortcut, relu)] = Some(BlockChoice {
            route,
            times_us,
            notes,
        });
    }

    /// Checks cuBLASLt's other heuristic candidates for the GEMM route like the route itself,
    /// times those that pass against the first (interleaved, GPU time) and keeps the fastest by
    /// the incumbent rule: a line saying which.
    fn choose_gemm_algo(
        &self,
        x: &CudaView<'_, T>,
        shortcut: Option<&CudaView<'_, T>>,
        relu: bool,
        reference: &mut DeviceCompare,
        probe: &mut CudaSlice<T>,
    ) -> Result<String> {
        let gemm = match &lock(&self.gemm)[relu as usize] {
            Some(Ok(g)) => g.clone(),
            _ => return Ok("gemm_epilogue: no cuBLASLt candidates to time".into()),
        };
        let n = gemm.algos();
        let mut ok = vec![0usize];
        for i in 1..n {
            crate::util::fill(&self.ctx, probe, T::from_f64(f64::NAN))?;
            if self
                .run_gemm(x, shortcut, relu, &mut probe.as_view_mut(), Some(i))
                .is_err()
            {
                continue;
            }
            let p = probe.device_ptr(self.ctx.stream()).0;
            // SAFETY: the probe holds the reference's element count of T.
            let (rel, bad) = unsafe { reference.check(p) }?;
            if passes(rel, bad, T::DTYPE) {
                ok.push(i);
            }
        }
        if ok.len() < 2 {
            return Ok(format!(
                "gemm_epilogue: cuBLASLt candidate 1 of {n} ({} passed the check)",
                ok.len()
            ));
        }
        let timed = time_interleaved_gpu(&self.ctx, RACE, ok.len(), |v, _| {
            self.run_gemm(x, shortcut, relu, &mut probe.as_view_mut(), Some(ok[v]))
        })?;
        let best = best_challenger((1..ok.len()).map(|v| (v, timed.paired(0, v))));
        let (pick, ratio) = best.map_or((0, 1.0), |(v, r)| (ok[v], r));
        gemm.choose(pick);
        Ok(format!(
            "gemm_epilogue: cuBLASLt candidate {} of {n} ({} passed the check; {ratio:.3}x the first's time)",
            pick + 1,
            ok.len()
        ))
    }

    /// Runs `r` into the poisoned probe buffer and compares it with `reference`: a line saying
    /// what passed, or why not.
    #[allow(clippy::too_many_arguments)]
    fn check_route(
        &self,
        r: BlockRoute,
        x: &CudaView<'_, T>,
        shortcut: Option<&CudaView<'_, T>>,
        relu: bool,
        reference: &mut DeviceCompare,
        probe: &mut CudaSlice<T>,
    ) -> std::result::Result<String, String> {
        let (rel, bad) = (|| -> Result<(f64, f64)> {
            crate::util::fill(&self.ctx, probe, T::from_f64(f64::NAN))?;
            self.run_fused(r, x, shortcut, relu, &mut probe.as_view_mut())?;
            let p = probe.device_ptr(self.ctx.stream()).0;
            // SAFETY: the probe holds the reference's element count of T.
            unsafe { reference.check(p) }
        })()
        .map_err(|e| e.to_string())?;
        if passes(rel, bad, T::DTYPE) {
            Ok(format!("{r}: matches unfused (relative L2 {rel:.2e})"))
        } else {
            Err(format!(
                "differs from unfused (relative L2 {rel:.2e}, {bad} non-finite elements)"
            ))
        }
    }

    /// Times the unfused composition (variant 0, into `y`) and `passed` (into the probe)
    /// against each other; the winner by the incumbent rule and every median.
    #[allow(clippy::too_many_arguments)]
    fn race(
        &self,
        passed: &[BlockRoute],
        x: &CudaView<'_, T>,
        shortcut: Option<&CudaView<'_, T>>,
        relu: bool,
        y: &mut CudaViewMut<'_, T>,
        probe: &mut CudaSlice<T>,
        notes: &mut Vec<String>,
    ) -> Result<(BlockRoute, Vec<(BlockRoute, f64)>)> {
        let routes: Vec<BlockRoute> = std::iter::once(BlockRoute::Unfused)
            .chain(passed.iter().copied())
            .collect();
        let result = time_interleaved_gpu(&self.ctx, RACE, routes.len(), |v, _| {
            if v == 0 {
                self.run_unfused(x, shortcut, relu, y)
            } else {
                self.run_fused(routes[v], x, shortcut, relu, &mut probe.as_view_mut())
            }
        });
        let timed = result?;
        let times: Vec<(BlockRoute, f64)> = routes
            .iter()
            .enumerate()
            .filter_map(|(v, &r)| timed.timing(v).map(|t| (r, t.median_us())))
            .collect();
        for (v, r) in routes.iter().enumerate().skip(1) {
            if let Some(e) = &timed.errors[v] {
                notes.push(format!("{r}: failed while timed: {e}"));
            } else if let Some(p) = timed.paired(0, v) {
                notes.push(format!("{r}: {p} against unfused"));
            }
        }
        let best = best_challenger((1..routes.len()).map(|v| (v, timed.paired(0, v))));
        let route = best.map_or(BlockRoute::Unfused, |(v, _)| routes[v]);
        Ok((route, times))
    }
}
