//! The first call of a [`ConvBnChain`]: the units route into the caller's buffers (the result
//! and the reference); the prologue route into NaN-poisoned buffers of its own, its output,
//! running statistics and — after both backwards on the same gradient — every gradient
//! checked against the units route's (on the device where they are tensors); then both
//! routes timed, forward plus backward, GPU time, interleaved rounds behind a head start.

use cudarc::driver::CudaSlice;

use super::api::lock;
use super::chain::ConvBnChain;
use super::chain::{AddendGrad, ChainArgs, ChainBackwardArgs, ChainBn, ChainChoice, ChainSaved};
use super::chain_graphs::LinkPart;
use super::chain_plan::ChainRoute;
use super::check::{chain_gradient_bound, tolerance};
use super::train_decide::rel_l2;
use crate::batchnorm::Fuse;
use crate::device_check::compare_on_device;
use crate::dtype::Element;
use crate::error::{CallExt, Result};
use crate::timing::{time_interleaved_gpu, InterleavedOptions};
use crate::tune::rule::best_challenger;

/// The reference of the prologue route's check, named in its errors.
const UNITS: &str = "the units route's result";

/// The race's options: a first call's budget, not a benchmark's.
const RACE: InterleavedOptions = InterleavedOptions {
    warmup_rounds: 1,
    min_sample_ms: 0.2,
    max_burst: 8,
    min_rounds: 6,
    max_rounds: 20,
    budget_ms: 60.0,
};

/// The engine configs' race: short, a first call's budget.
const ENGINES: InterleavedOptions = InterleavedOptions {
    warmup_rounds: 1,
    min_sample_ms: 0.1,
    max_burst: 8,
    min_rounds: 5,
    max_rounds: 12,
    budget_ms: 8.0,
};

/// One route's outputs during the decision: running statistics (from the call's starting
/// values), the output, and every gradient.
struct Outs<T> {
    rm: Vec<CudaSlice<f32>>,
    rv: Vec<CudaSlice<f32>>,
    y: CudaSlice<T>,
    dx: CudaSlice<T>,
    dw: Vec<CudaSlice<T>>,
    dgamma: Vec<CudaSlice<f32>>,
    dbeta: Vec<CudaSlice<f32>>,
    d_addend: Option<CudaSlice<T>>,
}

impl<T: Element> ConvBnChain<T> {
    /// Decides the route on this call's operands (see the module docs); the caller's buffers
    /// receive the units route's result and the running statistics move once.
    pub(super) fn decide(&self, a: &mut ChainArgs<'_, T>, saved: &mut ChainSaved<T>) -> Result<()> {
        self.ctx.refuse_under_capture(
            "the first call of a conv+BN training chain",
            "measure the routes (make the first call outside capture)",
        )?;
        let s = self.ctx.stream();
        let mut start = Vec::new();
        for b in &a.bn {
            start.push((
                s.clone_dtoh(&b.running_mean).call("cuMemcpyDtoH")?,
                s.clone_dtoh(&b.running_var).call("cuMemcpyDtoH")?,
            ));
        }
        self.run(ChainRoute::Units, a, saved)?;
        let mut notes = Vec::new();
        if !self.plan.eligible(ChainRoute::Prologue) {
            notes.push(format!(
                "prologue: refused by the plan: {}",
                self.plan.reason(ChainRoute::Prologue)
            ));
            self.record(ChainRoute::Units, Vec::new(), notes);
            return Ok(());
        }
        if let Err(e) = self.link_graphs() {
            notes.push(format!("prologue: not taken: {e}"));
            self.record(ChainRoute::Units, Vec::new(), notes);
            return Ok(());
        }
        for u in &self.units {
            u.load_fused_kernels()?;
        }
        let mut ref_outs = self.outs(&start, a)?;
        let mut outs = self.outs(&start, a)?;
        let mut probe = self.new_saved()?;
        match self.check_prologue(a, saved, &mut probe, &mut ref_outs, &mut outs) {
            Ok(lines) => notes.extend(lines.into_iter().map(|l| format!("prologue: {l}"))),
            Err(why) => {
                notes.push(format!("prologue: not taken: {why}"));
                self.record(ChainRoute::Units, Vec::new(), notes);
                return Ok(());
            }
        }
        self.tune_links(a, &mut probe, &mut outs, &mut notes)?;
        let mut probe_units = self.new_saved()?;
        let (times, wins) = self.race(
            a,
            [&mut probe_units, &mut probe],
            [&mut ref_outs, &mut outs],
            &mut notes,
        )?;
        let route = if wins {
            ChainRoute::Prologue
        } else {
            ChainRoute::Units
        };
        self.record(route, times, notes);
        Ok(())
    }

    /// Buffers for one route's outputs; running statistics from `start`.
    fn outs(&self, start: &[(Vec<f32>, Vec<f32>)], a: &ChainArgs<'_, T>) -> Result<Outs<T>> {
        let s = self.ctx.stream();
        let alloc = |len: usize| -> Result<CudaSlice<T>> {
            // SAFETY: poisoned or written before any read.
            unsafe { s.alloc::<T>(len.max(1)) }.call("cuMemAllocAsync")
        };
        let f32s = |len: usize| s.alloc_zeros::<f32>(len.max(1)).call("cuMemAllocAsync");
        Ok(Outs {
            rm: start
                .iter()
                .map(|(m, _)| s.clone_htod(m).call("cuMemcpyHtoD"))
                .collect::<Result<_>>()?,
            rv: start
                .iter()
                .map(|(_, v)| s.clone_htod(v).call("cuMemcpyHtoD"))
                .collect::<Result<_>>()?,
            y: alloc(a.y.len())?,
            dx: alloc(a.x.len())?,
            dw: a.w.iter().map(|w| alloc(w.len())).collect::<Result<_>>()?,
            dgamma: self
                .shapes
                .iter()
                .map(|s| f32s(s.c_out))
                .collect::<Result<_>>()?,
            dbeta: self
                .shapes
                .iter()
                .map(|s| f32s(s.c_out))
                .collect::<Result<_>>()?,
            d_addend: match self.plan.last {
                Fuse::AddRelu => Some(alloc(a.y.len())?),
                _ => None,
            },
        })
    }

    /// The prologue route's forward (from the call's starting running statistics) and both
    /// routes' backwards on the caller's y as the output gradient, compared: the lines saying
    /// what passed, or why not.
    fn check_prologue(
        &self,
        a: &mut ChainArgs<'_, T>,
        saved: &mut ChainSaved<T>,
        probe: &mut ChainSaved<T>,
        want: &mut Outs<T>,
        got: &mut Outs<T>,
    ) -> std::result::Result<Vec<String>, String> {
        let dt = T::DTYPE;
        let tol = tolerance(dt);
        let mut lines = Vec::new();
        let mut worst = (0.0f64, 0.0f64);
        let mut bad_what = None;
        // The output and running statistics within the type's tolerance; the gradients,
        // through the whole chain, within `chain_gradient_bound`.
        let mut judge = |what: String, rel: f64, bad: f64| {
            let bound = if what == "y" || what.starts_with("running") {
                tol
            } else {
                chain_gradient_bound(dt)
            };
            if !(bad == 0.0 && rel <= bound) && bad_what.is_none() {
                bad_what = Some(format!(
                    "{what}: relative L2 {rel:.2e} ({bad} non-finite; bound {bound:.0e})"
                ));
            }
            worst = (worst.0.max(rel), worst.1 + bad);
        };
        let r = (|| -> Result<()> {
            let s = self.ctx.stream();
            poison(&self.ctx, got)?;
            self.run(ChainRoute::Prologue, &mut fwd_args(a, got), probe)?;
            let (rel, bad) = compare_on_device(&self.ctx, &a.y, &got.y, UNITS)?;
            judge("y".into(), rel, bad);
            for (i, b) in a.bn.iter().enumerate() {
                for (name, w, g) in [
                    ("running_mean", &b.running_mean, &got.rm[i]),
                    ("running_var", &b.running_var, &got.rv[i]),
                ] {
                    let w = s.clone_dtoh(w).call("cuMemcpyDtoH")?;
                    let g = s.clone_dtoh(g).call("cuMemcpyDtoH")?;
                    let e = rel_l2(&w, &g);
                    if e > tol {
                        judge(format!("{name}[{i}]"), f64::INFINITY, 0.0);
                    }
                }
            }
            self.backward(bwd_args(a, want, false), saved)?;
            self.backward(bwd_args(a, got, true), probe)?;
            let (rel, bad) = compare_on_device(&self.ctx, &want.dx, &got.dx, UNITS)?;
            judge("dx".into(), rel, bad);
            for i in 0..self.shapes.len() {
                let (rel, bad) = compare_on_device(&self.ctx, &want.dw[i], &got.dw[i], UNITS)?;
                judge(format!("dw[{i}]"), rel, bad);
                for (name, w, g) in [
                    ("dgamma", &want.dgamma[i], &got.dgamma[i]),
                    ("dbeta", &want.dbeta[i], &got.dbeta[i]),
                ] {
                    let w = s.clone_dtoh(w).call("cuMemcpyDtoH")?;
                    let g = s.clone_dtoh(g).call("cuMemcpyDtoH")?;
                    judge(format!("{name}[{i}]"), rel_l2(&w, &g), 0.0);
                }
            }
            if let (Some(w), Some(g)) = (&want.d_addend, &got.d_addend) {
                let (rel, bad) = compare_on_device(&self.ctx, w, g, UNITS)?;
                judge("d_addend".into(), rel, bad);
            }
            Ok(())
        })();
        r.map_err(|e| format!("it failed: {e}"))?;
        match bad_what {
            Some(w) => Err(format!("it differs from the units route: {w}")),
            None => {
                lines.push(format!(
                    "matches the units route: y and running statistics (bound {tol:.0e}), every \
                     gradient (bound {:.0e}), worst relative L2 {:.2e}",
                    chain_gradient_bound(dt),
                    worst.0
                ));
                Ok(lines)
            }
        }
    }

    /// Times every finalized engine config of each link graph on the probe's state (a checked
    /// prologue forward and backward just ran on it) and makes the fastest the graph's
    /// default: the heuristics' first config is not always the fastest. One note per graph.
    fn tune_links(
        &self,
        a: &ChainArgs<'_, T>,
        probe: &mut ChainSaved<T>,
        o: &mut Outs<T>,
        notes: &mut Vec<String>,
    ) -> Result<()> {
        let graphs = self.link_graphs()?;
        for (i, g) in graphs.iter().enumerate() {
            for part in [LinkPart::Fprop, LinkPart::Dgrad, LinkPart::Wgrad] {
                let graph = g.graph(part);
                let n = graph.plans().len();
                if n < 2 {
                    continue;
                }
                let timed = time_interleaved_gpu(&self.ctx, ENGINES, n, |v, _| match part {
                    LinkPart::Fprop => self.fprop(i, g, a, probe, Some(v)),
                    LinkPart::Dgrad => self.dgrad(i, g, &mut bwd_args(a, o, true), probe, Some(v)),
                    LinkPart::Wgrad => self.wgrad(i, g, &mut bwd_args(a, o, true), probe, Some(v)),
                })?;
                let times: Vec<(usize, f64)> = (0..n)
                    .filter_map(|v| timed.timing(v).map(|t| (v, t.median_us())))
                    .collect();
                if let Some(&(best, _)) = times.iter().min_by(|x, y| x.1.total_cmp(&y.1)) {
                    graph.choose(best);
                }
                let line: Vec<String> = times
                    .iter()
                    .map(|(v, t)| format!("{} {t:.1} us", graph.plans()[*v].info.label()))
                    .collect();
                notes.push(format!(
                    "prologue: link {i} {part:?} engines: {} (took {})",
                    line.join(", "),
                    graph.plans()[graph.chosen()].info.label()
                ));
            }
        }
        // The timing left the probe's intermediate state mixed: the race rewrites it.
        Ok(())
    }

    /// Times the units route (variant 0) and the prologue route, each a forward and a
    /// backward into its own buffers, against each other: the medians, and whether the
    /// prologue route beats the incumbent by the crate's rule.
    fn race(
        &self,
        a: &ChainArgs<'_, T>,
        probes: [&mut ChainSaved<T>; 2],
        outs: [&mut Outs<T>; 2],
        notes: &mut Vec<String>,
    ) -> Result<(Vec<(ChainRoute, f64)>, bool)> {
        const ROUTES: [ChainRoute; 2] = [ChainRoute::Units, ChainRoute::Prologue];
        let [p0, p1] = probes;
        let [o0, o1] = outs;
        let mut probes = [p0, p1];
        let mut outs = [o0, o1];
        let timed = time_interleaved_gpu(&self.ctx, RACE, 2, |v, _| {
            let (p, o) = (&mut *probes[v], &mut *outs[v]);
            self.run(ROUTES[v], &mut fwd_args(a, o), p)?;
            self.backward(bwd_args(a, o, true), p)
        })?;
        let times: Vec<(ChainRoute, f64)> = (0..2)
            .filter_map(|v| timed.timing(v).map(|t| (ROUTES[v], t.median_us())))
            .collect();
        let mut wins = false;
        if let Some(e) = &timed.errors[1] {
            notes.push(format!("prologue: failed while timed: {e}"));
        } else if let Some(pd) = timed.paired(0, 1) {
            wins = best_challenger([(1, Some(pd))]).is_some();
            let verdict = if wins {
                "beats the units route"
            } else {
                "does not beat the units route"
            };
            notes.push(format!("prologue: {verdict}: {pd}"));
        }
        Ok((times, wins))
    }

    fn record(&self, route: ChainRoute, times_us: Vec<(ChainRoute, f64)>, notes: Vec<String>) {
        tracing::info!(%route, ?times_us, ?notes, "conv+BN training chain decided");
        *lock(&self.decision) = Some(ChainChoice {
            route,
            times_us,
            notes,
        });
    }
}

/// The caller's inputs with `o`'s output and running statistics.
fn fwd_args<'s, T>(a: &'s ChainArgs<'_, T>, o: &'s mut Outs<T>) -> ChainArgs<'s, T> {
    ChainArgs {
        x: a.x.slice(..),
        w: a.w.iter().map(|w| w.slice(..)).collect(),
        bn: a
            .bn
            .iter()
            .zip(o.rm.iter_mut().zip(o.rv.iter_mut()))
            .map(|(b, (m, v))| ChainBn {
                gamma: b.gamma.slice(..),
                beta: b.beta.slice(..),
                running_mean: m.as_view_mut(),
                running_var: v.as_view_mut(),
            })
            .collect(),
        addend: a.addend.as_ref().map(|v| v.slice(..)),
        y: o.y.as_view_mut(),
        momentum: a.momentum,
        eps: a.eps,
    }
}

/// The backward into `o`'s gradients of the forward that wrote `o.y` (`own_y`) or the caller's
/// y; the output gradient is the caller's y (any tensor of y's extent serves to compare and
/// time).
fn bwd_args<'s, T>(
    a: &'s ChainArgs<'_, T>,
    o: &'s mut Outs<T>,
    own_y: bool,
) -> ChainBackwardArgs<'s, T> {
    ChainBackwardArgs {
        x: a.x.slice(..),
        w: a.w.iter().map(|w| w.slice(..)).collect(),
        gamma: a.bn.iter().map(|b| b.gamma.slice(..)).collect(),
        beta: a.bn.iter().map(|b| b.beta.slice(..)).collect(),
        y: if own_y { o.y.as_view() } else { a.y.slice(..) },
        dy: a.y.slice(..),
        dx: Some(o.dx.as_view_mut()),
        accumulate_dx: false,
        dw: o.dw.iter_mut().map(|d| d.as_view_mut()).collect(),
        dgamma: o.dgamma.iter_mut().map(|d| d.as_view_mut()).collect(),
        dbeta: o.dbeta.iter_mut().map(|d| d.as_view_mut()).collect(),
        d_addend: match &mut o.d_addend {
            Some(d) => AddendGrad::Into(d.as_view_mut()),
            None => AddendGrad::None,
        },
    }
}

/// NaN into every tensor output of `o` (a route that leaves one unwritten fails the check).
fn poison<T: Element>(ctx: &crate::context::Context, o: &mut Outs<T>) -> Result<()> {
    let nan = T::from_f64(f64::NAN);
    crate::util::fill(ctx, &mut o.y, nan)?;
    crate::util::fill(ctx, &mut o.dx, nan)?;
    for d in o.dw.iter_mut().chain(o.d_addend.as_mut()) {
        crate::util::fill(ctx, d, nan)?;
    }
    Ok(())
}
