//! The first call of a [`ConvStats`]: the unfused route into the caller's buffers (the
//! reference), the own kernel and the graph route's first engine configs each checked against
//! it in NaN-poisoned buffers, those that pass timed against it (GPU time, interleaved rounds
//! behind a head start), and the incumbent rule.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr};

use super::api::lock;
use super::check::passes;
use super::conv_stats::{ConvStats, StatsChoice};
use super::stats_plan::{stats_error, stats_tolerance, StatsRoute};
use crate::device_check::DeviceCompare;
use crate::dtype::Element;
use crate::error::{CallExt, Result};
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

/// Median GPU µs per timed variant, by name.
type Times = Vec<(String, f64)>;

/// The reference: y widened on the device (compared there), the sums on the host (c_out each).
struct Reference {
    y: DeviceCompare,
    sum: Vec<f64>,
    sqsum: Vec<f64>,
}

/// A fused candidate of the first call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Candidate {
    /// The own kernel (`own_pointwise`).
    Own,
    /// The graph route's engine config `i`.
    Graph(usize),
}

impl Candidate {
    fn name(self) -> String {
        match self {
            Candidate::Own => StatsRoute::OwnPointwise.name().into(),
            Candidate::Graph(i) => format!("graph_genstats [{i}]"),
        }
    }
}

/// One candidate's check: y's (relative L2, non-finite count) from the device, and its sum
/// and sqsum on the host.
type Checked = ((f64, f64), Vec<f64>, Vec<f64>);

/// The measurement's own outputs (the caller's keep the unfused result).
struct Probe<T> {
    y: CudaSlice<T>,
    sum: CudaSlice<f32>,
    sqsum: CudaSlice<f32>,
}

fn host<E: Element>(ctx: &crate::context::Context, v: &CudaView<'_, E>) -> Result<Vec<f64>> {
    Ok(ctx
        .stream()
        .clone_dtoh(v)
        .call("cuMemcpyDtoH")?
        .into_iter()
        .map(Element::to_f64)
        .collect())
}

impl<T: Element> ConvStats<T> {
    /// Decides the route on this call's operands (see the type's documentation); the caller's
    /// buffers receive the unfused route's result.
    pub(super) fn decide(
        &self,
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        y: &mut CudaViewMut<'_, T>,
        sum: &mut CudaViewMut<'_, f32>,
        sqsum: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        self.ctx.refuse_under_capture(
            "the first call of a conv+stats problem",
            "measure the routes (make the first call outside capture)",
        )?;
        self.run_unfused(x, w, y, sum, sqsum)?;
        let mut notes = Vec::new();
        let candidates = self.candidates(&mut notes);
        if candidates.is_empty() {
            self.record(StatsRoute::Unfused, None, Vec::new(), notes);
            return Ok(());
        }
        let s = self.ctx.stream();
        let y_len = y.len();
        let y_ptr = y.device_ptr(s).0;
        let mut reference = Reference {
            // SAFETY: y holds y_len elements of T on the Context's device (validated), written
            // above on this stream.
            y: unsafe { DeviceCompare::new(&self.ctx, T::DTYPE, y_ptr, y_len) }?,
            sum: host(&self.ctx, &sum.slice(..))?,
            sqsum: host(&self.ctx, &sqsum.slice(..))?,
        };
        let reference_bad = reference.y.reference_nonfinite();
        if reference_bad != 0.0 {
            notes.push(format!(
                "fused routes not checked: the unfused result has {reference_bad} non-finite \
                 elements on this call's data"
            ));
            self.record(StatsRoute::Unfused, None, Vec::new(), notes);
            return Ok(());
        }
        // SAFETY: every measured route writes these buffers (poisoned first) before any read.
        let mut probe = Probe {
            y: unsafe { s.alloc::<T>(y_len.max(1)) }.call("cuMemAllocAsync")?,
            sum: unsafe { s.alloc::<f32>(reference.sum.len().max(1)) }.call("cuMemAllocAsync")?,
            sqsum: unsafe { s.alloc::<f32>(reference.sum.len().max(1)) }.call("cuMemAllocAsync")?,
        };
        let mut passed = Vec::new();
        for (c, label) in candidates {
            match self.check_candidate(c, x, w, &mut reference, &mut probe) {
                Ok(line) => {
                    notes.push(format!("{}{label}: {line}", c.name()));
                    passed.push(c);
                }
                Err(why) => notes.push(format!("{}{label}: dropped: {why}", c.name())),
            }
        }
        if passed.is_empty() {
            self.record(StatsRoute::Unfused, None, Vec::new(), notes);
            return Ok(());
        }
        let (best, times) = self.race(&passed, x, w, y, sum, sqsum, &mut probe, &mut notes)?;
        match best {
            Some(Candidate::Own) => self.record(StatsRoute::OwnPointwise, None, times, notes),
            Some(Candidate::Graph(i)) => {
                let graph = self.graph()?;
                graph.choose(i);
                let label = graph.plans()[i].info.label();
                self.record(StatsRoute::GraphGenstats, Some(label), times, notes);
            }
            None => self.record(StatsRoute::Unfused, None, times, notes),
        }
        Ok(())
    }

    /// The fused candidates the plan admits, each with a label for its notes (the own kernel
    /// first, then the graph's finalized engine configs), and notes on what is left out.
    fn candidates(&self, notes: &mut Vec<String>) -> Vec<(Candidate, String)> {
        let mut out = Vec::new();
        if self.plan.eligible(StatsRoute::OwnPointwise) {
            out.push((Candidate::Own, String::new()));
        } else {
            notes.push(format!(
                "own_pointwise: refused by the plan: {}",
                self.plan.reason(StatsRoute::OwnPointwise)
            ));
        }
        if !self.plan.eligible(StatsRoute::GraphGenstats) {
            notes.push(format!(
                "graph_genstats: refused by the plan: {}",
                self.plan.reason(StatsRoute::GraphGenstats)
            ));
            return out;
        }
        let graph = match self.graph() {
            Ok(g) => g,
            Err(e) => {
                notes.push(format!("graph_genstats: no plan: {e}"));
                return out;
            }
        };
        notes.push(format!(
            "graph_genstats: {} engine configs listed, {} finalized",
            graph.listed(),
            graph.plans().len()
        ));
        for s in graph.skipped() {
            notes.push(format!("graph_genstats: not finalized: {s}"));
        }
        for (i, p) in graph.plans().iter().enumerate() {
            let label = format!(
                " {} (workspace {} B, finalize {:.1} ms)",
                p.info.label(),
                p.workspace(),
                p.finalize_ms
            );
            out.push((Candidate::Graph(i), label));
        }
        out
    }

    /// Stores the decision.
    fn record(
        &self,
        route: StatsRoute,
        engine: Option<String>,
        times_us: Vec<(String, f64)>,
        notes: Vec<String>,
    ) {
        tracing::info!(%route, ?engine, ?times_us, ?notes, "conv+stats route decided");
        *lock(&self.decision) = Some(StatsChoice {
            route,
            engine,
            times_us,
            notes,
        });
    }

    /// Runs candidate `c` into the probe's buffers.
    fn run_candidate(
        &self,
        c: Candidate,
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        probe: &mut Probe<T>,
    ) -> Result<()> {
        let (y, sum, sqsum) = (
            &mut probe.y.as_view_mut(),
            &mut probe.sum.as_view_mut(),
            &mut probe.sqsum.as_view_mut(),
        );
        match c {
            Candidate::Own => self.run_own(x, w, y, sum, sqsum),
            Candidate::Graph(i) => self.run_graph(Some(i), x, w, y, sum, sqsum),
        }
    }

    /// Runs candidate `c` into the poisoned probe and compares y, sum and sqsum with the
    /// reference: a line saying what passed, or why not.
    fn check_candidate(
        &self,
        c: Candidate,
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        reference: &mut Reference,
        probe: &mut Probe<T>,
    ) -> std::result::Result<String, String> {
        let got = (|| -> Result<Checked> {
            crate::util::fill(&self.ctx, &mut probe.y, T::from_f64(f64::NAN))?;
            crate::util::fill(&self.ctx, &mut probe.sum, f32::NAN)?;
            crate::util::fill(&self.ctx, &mut probe.sqsum, f32::NAN)?;
            self.run_candidate(c, x, w, probe)?;
            let y_ptr = probe.y.device_ptr(self.ctx.stream()).0;
            // SAFETY: the probe's y holds the reference's element count of T.
            let verdict = unsafe { reference.y.check(y_ptr) }?;
            Ok((
                verdict,
                host(&self.ctx, &probe.sum.as_view())?,
                host(&self.ctx, &probe.sqsum.as_view())?,
            ))
        })()
        .map_err(|e| e.to_string())?;
        let ((rel_l2, nonfinite), got_sum, got_sqsum) = got;
        let dt = T::DTYPE;
        let passed_y = passes(rel_l2, nonfinite, dt);
        let count = self.rows().map_err(|e| e.to_string())?;
        let (es, eq) = stats_error(
            (&reference.sum, &reference.sqsum),
            (&got_sum, &got_sqsum),
            count,
        );
        let tol = stats_tolerance(dt, count);
        let line = format!(
            "y relative L2 {rel_l2:.2e} ({nonfinite} non-finite), sum {es:.2e}, sqsum {eq:.2e} \
             (bound {tol:.1e})"
        );
        if passed_y && es <= tol && eq <= tol {
            Ok(format!("matches unfused: {line}"))
        } else {
            Err(format!("differs from unfused: {line}"))
        }
    }

    /// Times the unfused route (variant 0, into the caller's buffers) and the candidates that
    /// passed (into the probe) against each other: the winner by the incumbent rule (None:
    /// unfused) and every median.
    #[allow(clippy::too_many_arguments)]
    fn race(
        &self,
        passed: &[Candidate],
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        y: &mut CudaViewMut<'_, T>,
        sum: &mut CudaViewMut<'_, f32>,
        sqsum: &mut CudaViewMut<'_, f32>,
        probe: &mut Probe<T>,
        notes: &mut Vec<String>,
    ) -> Result<(Option<Candidate>, Times)> {
        let n = passed.len() + 1;
        let timed = time_interleaved_gpu(&self.ctx, RACE, n, |v, _| {
            if v == 0 {
                self.run_unfused(x, w, y, sum, sqsum)
            } else {
                self.run_candidate(passed[v - 1], x, w, probe)
            }
        })?;
        let name = |v: usize| {
            if v == 0 {
                "unfused".to_string()
            } else {
                passed[v - 1].name()
            }
        };
        let times = (0..n)
            .filter_map(|v| timed.timing(v).map(|t| (name(v), t.median_us())))
            .collect();
        for v in 1..n {
            if let Some(e) = &timed.errors[v] {
                notes.push(format!("{}: failed while timed: {e}", name(v)));
            } else if let Some(p) = timed.paired(0, v) {
                notes.push(format!("{}: {p} against unfused", name(v)));
            }
        }
        let best = best_challenger((1..n).map(|v| (v, timed.paired(0, v))));
        Ok((best.map(|(v, _)| passed[v - 1]), times))
    }
}
