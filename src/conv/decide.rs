//! The dispatcher's decisions: the first call of a direction (the process cache or the tuning
//! file, else the plan's candidates, measured by `choice` when there are several), a route forced
//! by the caller, and the run-time fallback when a route fails. The GPU work they need (cuDNN's
//! algorithm queries, the measurement) goes through `cudnn` and `choice`; the execution of the
//! route itself through `route`.

use std::sync::Arc;

use cudarc::driver::DevicePtr;

use super::api::Conv2d;
use super::choice::{
    self, with_not_run, with_refused, AutoReport, CandidateReport, ChoiceKey, ChoiceOrigin,
    ConvChoice, CudnnSearch, MeasureInput, Outcome, MAX_CUDNN_CANDIDATES,
};
use super::cudnn::usable;
use super::cudnn_graph_run;
use super::plan::{ConvPath, ConvPlan, Route};
use super::problem::{column_tiles, CudnnPtrs, Direction, GraphEngine, WinogradEngine};
use super::route::{self, Exec};
use super::state::{lock, Decided, Pending};
use super::winograd::{fused, launch as wg};
use crate::dtype::{DType, Element};
use crate::error::{CallExt, Error, Result};
use crate::kernels::{self, KernelFile, KernelState};
use crate::tune::budget::{not_now, Budget, MAX_SETTLES, NOT_COMPILED};

impl<T: Element> Conv2d<T> {
    /// cuDNN's usable algorithms for `d` as routes: the heuristic list's first
    /// [`MAX_CUDNN_CANDIDATES`] (or `limit`), or Find's fastest on `p` (scratch output).
    pub(super) fn cudnn_execs(
        &self,
        d: Direction,
        p: CudnnPtrs,
        limit: usize,
    ) -> Result<(Vec<Exec>, Vec<String>, ChoiceOrigin)> {
        let conv = self.core.cudnn_conv()?.clone();
        let cfg = self.ctx.config();
        let cap = cfg.cudnn_workspace_bytes();
        let det = cfg.deterministic && d != Direction::Forward;
        let started = std::time::Instant::now();
        let list = {
            let mut g = self.ctx.lock()?;
            let h = g.cudnn()?;
            // SAFETY: live handle under the lock.
            unsafe { conv.heuristics(h, d) }?
        };
        // A process's first query of a kind loads cuDNN's legacy engines (the time a first
        // call's budget pays before measuring).
        tracing::debug!(direction = %d, ms = started.elapsed().as_secs_f64() * 1e3,
            listed = list.len(), "cuDNN legacy algorithm heuristics");
        let (mut ok, excluded, mut notes) = usable(&list, self.core.dtype, cap, det);
        let mut origin = ChoiceOrigin::Planned;
        if self.core.search == CudnnSearch::Find && limit > 1 {
            let ws_bytes = ok.iter().map(|q| q.memory).max().unwrap_or(0);
            let out_role = choice::output_role(d);
            let elems = self.core.lens[out_role];
            // SAFETY: Find's output, written before it is read; freed after Find (which blocks).
            let out =
                unsafe { self.ctx.stream().alloc::<T>(elems.max(1)) }.call("cuMemAllocAsync")?;
            let (op, _go) = out.device_ptr(self.ctx.stream());
            let mut q = p;
            match out_role {
                0 => q.x = op,
                1 => q.w = op,
                _ => q.y = op,
            }
            let found = {
                let mut g = self.ctx.lock()?;
                let h = g.cudnn()?;
                let ws = g.workspace(ws_bytes)?;
                // SAFETY: validated caller inputs, our own output of the output's extent, a
                // workspace of ws_bytes; the handle is bound to the Context's stream.
                unsafe { conv.find(h, d, q, ws, ws_bytes) }?
            };
            let (f, ex, n) = usable(&found, self.core.dtype, cap, det);
            notes = n;
            ok = f;
            if ex {
                notes.push(
                    "determinism excluded the algorithm cuDNN's Find measured fastest".into(),
                );
            }
            origin = ChoiceOrigin::CudnnFind;
            ok.truncate(1);
        } else if excluded {
            notes.push("determinism excluded the algorithm cuDNN's heuristic ranks first".into());
        }
        let mut execs = Vec::new();
        for perf in ok.iter().take(limit.clamp(1, MAX_CUDNN_CANDIDATES)) {
            match self.core.exec_of(&self.ctx, d, Route::cudnn(perf.algo)) {
                Ok(e) => execs.push(e),
                Err(e) => notes.push(format!("{}: {e}", perf.algo.label())),
            }
        }
        if execs.is_empty() {
            notes.push("cuDNN offered no usable algorithm".into());
        }
        Ok((execs, notes, origin))
    }

    /// Whether a cached or file route fits this object's plan for `d`.
    pub(super) fn acceptable(&self, plan: &ConvPlan, r: &Route) -> bool {
        if r.path == ConvPath::CudnnGraph {
            let target = self.core.target(&self.ctx);
            return cudnn_graph_run::fits(&target, plan, r, self.core.search);
        }
        if !plan.candidates.iter().any(|c| c.path == r.path) {
            return false;
        }
        match r.path {
            ConvPath::Cudnn => r.cudnn_algo.is_some_and(|a| {
                a.direction == plan.direction
                    && a.is_known()
                    && a.math.acceptable(self.core.dtype)
                    && self.core.cudnn.is_some()
            }),
            ConvPath::WinogradF2x3 | ConvPath::WinogradF4x3 => plan
                .candidates
                .iter()
                .any(|c| c.path == r.path && c.engine == r.engine),
            _ => true,
        }
    }

    /// Decides the route of `d`'s calls that overwrite (`accumulate = false`) or add to their
    /// output (first call of that mode): the process cache or the file (keyed by the mode),
    /// else the plan's candidates, measured when there are several. Accumulating calls are
    /// decided among the candidates that can add ([`ConvPlan::accumulate_refusal`]; the others
    /// are named in the notes and the report), each checked and timed adding
    /// ([`choice::MeasureInput::accumulate`]); when none can, the plan's fallback runs them.
    /// An exhaustive budget ([`crate::Config::conv_tune_budget_ms`] = 0, an explicit tuning run)
    /// measures afresh, over what the process cache or the file holds, and replaces it.
    pub(super) fn decide(&self, d: Direction, p: CudnnPtrs, accumulate: bool) -> Result<Decided> {
        // The budget begins here: finalizing cuDNN's engine configs counts against it.
        let budget = Budget::new(self.ctx.config().conv_tune_budget_ms);
        let plan = self.plan_for(d);
        let ordinal = self.ctx.info().ordinal as u32;
        let key = ChoiceKey::of(ordinal, plan, self.core.search, accumulate);
        let costly = plan.measured || plan.candidates.iter().any(|r| r.path == ConvPath::Cudnn);
        // A tuning-file route that failed its check: shown in the new measurement's report.
        let mut refused = None;
        if costly && !budget.exhaustive() {
            match self.cached(d, p, plan, &key) {
                Ok(dec) => return Ok(dec),
                Err(r) => refused = r,
            }
        }
        let listing = std::time::Instant::now();
        let (execs, mut notes, origin) = self.candidate_execs(d, p, plan, &budget)?;
        let budget = budget.past_library_start(listing.elapsed());
        let (execs, cannot_add) = can_add(plan, execs, key.accumulate, &mut notes);
        if execs.is_empty() && !cannot_add.is_empty() {
            return self.adding_fallback(d, p, plan, &cannot_add, notes);
        }
        let (mut execs, not_run, waiting) = self.runnable_now(d, p, execs, &budget, &mut notes);
        notes.extend(choice::drop_uncheckable_f32_graph(
            &mut execs,
            self.core.dtype,
        ));
        match execs.len() {
            0 => self.no_candidate(d, plan, notes),
            // Alone only because the others' kernels are not compiled: still checked (a few
            // ms), so that the choice is a measured one with its report.
            1 if not_run.is_empty() => {
                let mut c = ConvChoice::planned(execs[0].route, origin);
                c.notes = notes;
                if origin == ChoiceOrigin::CudnnFind {
                    self.remember(&key, &c);
                }
                tracing::info!(problem = ?self.core.shape, direction = %d, route = %c.route,
                    origin = origin.name(), "convolution decided");
                Ok(Decided {
                    exec: execs[0],
                    choice: c,
                    report: None,
                    pending: None,
                })
            }
            _ => {
                let skipped: Vec<(Route, String)> = not_run
                    .iter()
                    .map(|e| (e.route, NOT_COMPILED.to_string()))
                    .chain(cannot_add)
                    .collect();
                let mut dec = self.measured(d, p, &key, &execs, notes, budget, &skipped);
                if let (Some(r), Some(rep)) = (refused, dec.report.as_mut()) {
                    with_refused(Arc::make_mut(rep), *r);
                }
                let mut left_out = not_run;
                left_out.extend(budget_cut(&execs, dec.report.as_deref()));
                // 16-bit only: an f32 graph config needs its true-f32 check's companion.
                let more_graph = self.core.dtype != DType::F32
                    && cudnn_graph_run::first_call_limit_reached(&execs, budget.exhaustive());
                if (!left_out.is_empty() || more_graph)
                    && dec.choice.origin == ChoiceOrigin::Measured
                {
                    dec.pending = Some(Pending {
                        execs: left_out,
                        files: waiting,
                        more_graph,
                        epoch: u64::MAX, // looked at by the next call
                        settles: 0,
                    });
                }
                Ok(dec)
            }
        }
    }

    /// The process cache's (or the tuning file's) route for `key`, when it fits this object's
    /// plan and can be completed; `Err` to decide afresh, with the file route's failed check
    /// when that was why.
    fn cached(
        &self,
        d: Direction,
        p: CudnnPtrs,
        plan: &ConvPlan,
        key: &ChoiceKey,
    ) -> std::result::Result<Decided, Option<Box<CandidateReport>>> {
        let ctx = &self.ctx;
        let cfg = ctx.config();
        if let Some(path) = &cfg.tuning_cache {
            match choice::device_tag(ctx) {
                Ok(tag) => choice::ensure_loaded(path, key.device, &tag, cfg.plan_cache_capacity),
                Err(e) => tracing::warn!(error = %e, "convolution tuning cache not read"),
            }
        }
        let mut c = choice::lookup(key).ok_or(None)?;
        let adds = !key.accumulate || plan.accumulate_refusal(c.route.path).is_none();
        if !adds || !self.acceptable(plan, &c.route) {
            tracing::warn!(route = %c.route, direction = %d,
                "cached convolution choice does not fit this problem's plan; deciding again");
            return Err(None);
        }
        match self.core.exec_of(ctx, d, c.route) {
            Ok(exec) => {
                let report = if choice::verify_before_use(&c, self.core.dtype) {
                    Some(Arc::new(self.verified(d, p, plan, exec, key.accumulate)?))
                } else {
                    None
                };
                // Another Context's measurement (a file entry and a fallback say where they
                // came from themselves).
                if matches!(c.origin, ChoiceOrigin::Measured | ChoiceOrigin::CudnnFind) {
                    c.origin = ChoiceOrigin::Memory;
                }
                tracing::debug!(problem = ?self.core.shape, direction = %d,
                    route = %c.route, origin = c.origin.name(), "convolution choice cached");
                Ok(Decided {
                    exec,
                    choice: c,
                    report,
                    pending: None,
                })
            }
            Err(e) => {
                tracing::warn!(route = %c.route, error = %e,
                    "cached convolution choice cannot run; deciding again");
                Err(None)
            }
        }
    }

    /// `exec`, a Winograd route read from the tuning file, checked as a measurement would with
    /// the plan's other candidates as the baseline, or an f32 graph route checked against a
    /// true-f32 route ([`choice::verify`]), in the mode of the calls it is for (`accumulate`:
    /// adding, among the routes that can): its report when it passes; when it does not (with a
    /// warning: the problem is measured again), its line of the check when it ran.
    fn verified(
        &self,
        d: Direction,
        p: CudnnPtrs,
        plan: &ConvPlan,
        exec: Exec,
        accumulate: bool,
    ) -> std::result::Result<AutoReport, Option<Box<CandidateReport>>> {
        let fail = |why: String, line: Option<Box<CandidateReport>>| {
            tracing::warn!(route = %exec.route, direction = %d, why = %why,
                "tuning-file choice failed the accuracy check; measuring again");
            Err(line)
        };
        // Every candidate is the baseline's: no budget cuts the check.
        let budget = Budget::new(0);
        let mut execs = if choice::needs_true_f32_check(&exec, self.core.dtype) {
            // A graph route is held to true f32 only: a true-f32 route is its reference.
            self.true_f32_companion(d, p, &mut Vec::new())
        } else {
            match self.candidate_execs(d, p, plan, &budget) {
                Ok((v, _, _)) => v,
                Err(e) => return fail(e.to_string(), None),
            }
        };
        execs.retain(|e| e.route.path.winograd_tile().is_none());
        if accumulate {
            execs.retain(|e| plan.accumulate_refusal(e.route.path).is_none());
        }
        execs.push(exec);
        let inp = self.measure_input(d, &execs, p, budget, true, accumulate);
        match choice::verify(&inp) {
            Ok((true, report)) => Ok(report),
            Ok((false, report)) => {
                let line = report.candidates.last().cloned().map(Box::new);
                fail(format!("{report}"), line)
            }
            Err(e) => fail(e.to_string(), None),
        }
    }

    /// The plan's candidates completed into routes (cuDNN's as its usable algorithms), the
    /// notes on those that could not be, and where a lone cuDNN route came from.
    fn candidate_execs(
        &self,
        d: Direction,
        p: CudnnPtrs,
        plan: &ConvPlan,
        budget: &Budget,
    ) -> Result<(Vec<Exec>, Vec<String>, ChoiceOrigin)> {
        let mut execs: Vec<Exec> = Vec::new();
        let mut notes: Vec<String> = Vec::new();
        let mut origin = ChoiceOrigin::Planned;
        let several = plan.candidates.len() > 1;
        for r in &plan.candidates {
            // Measured among others, the tiled route is one route per engine config of its
            // tiled problem; forced, it runs the first that passes the true-f32 check
            // (`checked_graph_engine`).
            if r.path == ConvPath::CudnnTiled && several {
                let target = self.core.target(&self.ctx);
                let v = super::conv_tiled::engine_execs(&target, budget, &mut notes);
                if v.is_empty() {
                    execs.push(self.core.exec_of(&self.ctx, d, *r)?);
                } else {
                    execs.extend(v);
                }
                continue;
            }
            if r.path != ConvPath::Cudnn {
                execs.push(self.core.exec_of(&self.ctx, d, *r)?);
                continue;
            }
            if let Some(v) =
                cudnn_graph_run::candidates(&self.core, &self.ctx, plan, budget, &mut notes)
            {
                let graph_configs = v.len();
                execs.extend(v);
                if self.core.dtype == DType::F32 {
                    execs.extend(self.true_f32_companion(d, p, &mut notes));
                } else if graph_configs < 2 {
                    execs.extend(self.legacy_companion(d, p, graph_configs, &mut notes));
                }
                continue;
            }
            // One cuDNN algorithm when nothing else competes and the search is Find; the
            // heuristic mode times several.
            match self.cudnn_execs(d, p, MAX_CUDNN_CANDIDATES) {
                Ok((v, n, o)) => {
                    execs.extend(v);
                    notes.extend(n);
                    if !several {
                        origin = o;
                    }
                }
                Err(e) => notes.push(format!("cuDNN: {e}")),
            }
        }
        // f32 graph engine configs without a true-f32 route to check them against (each
        // would be dropped): one joins them.
        let dtype = self.core.dtype;
        if execs.iter().any(|e| choice::needs_true_f32_check(e, dtype))
            && !execs.iter().any(|e| choice::is_true_f32(&e.route))
        {
            execs.extend(self.true_f32_companion(d, p, &mut notes));
        }
        choice::distinct_after_incumbent(&mut execs);
        Ok((execs, notes, origin))
    }

    /// No candidate could be prepared: the plan's fallback, unmeasured.
    fn no_candidate(&self, d: Direction, plan: &ConvPlan, notes: Vec<String>) -> Result<Decided> {
        let fb = plan.fallback_route(ConvPath::Cudnn).ok_or_else(|| {
            Error::NotSupported(format!(
                "no route can run this {}: {}",
                d.describe(),
                notes.join("; ")
            ))
        })?;
        tracing::warn!(direction = %d, route = %fb, notes = ?notes,
            "no candidate route could be prepared; falling back");
        let mut c = ConvChoice::planned(fb, ChoiceOrigin::Fallback);
        c.notes = notes;
        Ok(Decided {
            exec: self.core.exec_of(&self.ctx, d, fb)?,
            choice: c,
            report: None,
            pending: None,
        })
    }

    /// Several candidates: `auto`'s measurement on the caller's operands picks one (remembered);
    /// when nothing could be checked, the incumbent runs unmeasured. Candidates the budget left
    /// unmeasured are named in the choice's notes, the report and a trace; those not run for
    /// want of compiled kernels (`not_run`) are Skipped lines of the report (the choice is kept
    /// and written as any measured one: the best of what could run), and so are those an
    /// accumulating decision excluded because they cannot add. The mode is `key`'s.
    #[allow(clippy::too_many_arguments)] // one decision's inputs
    fn measured(
        &self,
        d: Direction,
        p: CudnnPtrs,
        key: &ChoiceKey,
        execs: &[Exec],
        mut notes: Vec<String>,
        budget: Budget,
        not_run: &[(Route, String)],
    ) -> Decided {
        // NVRTC is not waited for under a budget: without conv_direct.cu the incumbent's own
        // result is the forward's reference (the report names it).
        let direct_reference = budget.exhaustive()
            || d != Direction::Forward
            || self.ctx.kernel_ready(&kernels::CONV_DIRECT);
        if !direct_reference {
            self.ctx.prepare_kernels(&[&kernels::CONV_DIRECT]);
            notes.push(
                "reference: the incumbent's result (conv_direct.cu, the direct f32 reference, \
                 is not compiled yet)"
                    .into(),
            );
        }
        let inp = self.measure_input(d, execs, p, budget, direct_reference, key.accumulate);
        match choice::measure(&inp) {
            Ok((w, mut report)) => {
                // A route joined only to check f32 graph configs (the true-f32 companion of a
                // plan that lists one graph path) does not win over the plan's own paths.
                let paths = choice::measured_paths(&self.plan_for(d).candidates);
                let w = choice::winner_within(&report, w, &paths);
                report.winner = w;
                if let Some(n) = choice::budget_note(&report, &budget) {
                    tracing::info!(problem = ?self.core.shape, dtype = %self.core.dtype,
                        direction = %d, spent_ms = budget.spent_ms(), "{n}");
                    notes.push(n);
                }
                with_not_run(&mut report, not_run);
                let win = &report.candidates[w];
                let inc = &report.candidates[report.incumbent];
                let c = ConvChoice {
                    route: execs[w].route,
                    origin: ChoiceOrigin::Measured,
                    median_us: win.median_ms.map_or(f64::NAN, |m| m * 1e3),
                    incumbent_us: inc.median_ms.map_or(f64::NAN, |m| m * 1e3),
                    candidates: execs.len() as u32,
                    notes,
                };
                tracing::info!(problem = ?self.core.shape, dtype = %self.core.dtype,
                    direction = %d, accumulate = key.accumulate, route = %c.route,
                    wall_ms = report.wall_ms, "convolution measured:\n{report}");
                self.remember(key, &c);
                Decided {
                    exec: execs[w],
                    choice: c,
                    report: Some(Arc::new(report)),
                    pending: None,
                }
            }
            Err(e) => {
                // Nothing could be checked: take the incumbent unmeasured (it is what a forced
                // policy would run), remembered only here.
                tracing::warn!(direction = %d, error = %e,
                    "convolution measurement failed; running the incumbent unmeasured");
                let i = choice::unmeasured_incumbent(execs, self.core.dtype);
                let mut c = ConvChoice::planned(execs[i].route, ChoiceOrigin::Fallback);
                notes.push(format!("measurement failed: {e}"));
                c.notes = notes;
                Decided {
                    exec: execs[i],
                    choice: c,
                    report: None,
                    pending: None,
                }
            }
        }
    }

    /// The kernel files route `e` of `d` uses (none for cuDNN), `gemm_search.cu` with the tuned
    /// GEMM. A Winograd transform's width depends on the pointers: the widths of the aligned
    /// case and of the caller's operands `p` (when known) are both listed.
    pub(super) fn route_kernels(
        &self,
        d: Direction,
        e: &Exec,
        p: Option<CudnnPtrs>,
    ) -> Vec<&'static KernelFile> {
        let dtype = self.core.dtype;
        let gemm = self.ctx.config().gemm_search;
        let mut v: Vec<&'static KernelFile> = Vec::new();
        match e.route.path {
            ConvPath::Cudnn | ConvPath::CudnnGraph => {}
            ConvPath::CudnnDual => v.push(&kernels::CONV_DUAL),
            ConvPath::CudnnTiled => v.push(&kernels::CONV_TILED),
            ConvPath::Direct => v.push(&kernels::CONV_DIRECT),
            ConvPath::DirectFilter => v.push(&kernels::CONV_WGRAD),
            ConvPath::StemFilter => {
                let nt = column_tiles(&self.core.shape);
                v.extend(super::stem::unit(dtype, nt));
            }
            ConvPath::StemForward => v.extend(super::stem::unit(dtype, super::stem::FORWARD_UNIT)),
            ConvPath::Im2colGemm => {
                v.push(&kernels::IM2COL);
                if gemm {
                    v.push(&kernels::GEMM_SEARCH);
                }
            }
            ConvPath::WinogradF2x3 | ConvPath::WinogradF4x3 => {
                let Some(g) = e.winograd.as_ref() else {
                    return v;
                };
                let tile = g.tile;
                v.push(wg::filter_unit(dtype, tile));
                // The equivalent forward problem reads x (the data gradient's: dy), writes y
                // (dx); the scratch tensors between the stages are aligned.
                let (input, output) = match p {
                    Some(p) if d == Direction::Forward => (vec![0, p.x], vec![0, p.y]),
                    Some(p) => (vec![0, p.y], vec![0, p.x]),
                    None => (vec![0], vec![0]),
                };
                match e.route.engine {
                    Some(WinogradEngine::Fused) => v.extend(fused::unit(dtype, Some(tile))),
                    engine => {
                        for (stage, ch, ptrs) in [
                            (wg::Stage::Input, g.problem.c_in, &input),
                            (wg::Stage::Output, g.problem.c_out, &output),
                        ] {
                            for &ptr in ptrs {
                                let vec = wg::choose_vec(stage, tile, dtype, ch, &[ptr]);
                                v.extend(wg::transform_unit(stage, dtype, tile, vec));
                            }
                        }
                        match engine {
                            Some(WinogradEngine::Direct) => v.push(wg::direct_unit(dtype)),
                            _ if gemm => v.push(&kernels::GEMM_SEARCH),
                            _ => {}
                        }
                    }
                }
            }
        }
        v.sort_by_key(|f| f.name);
        v.dedup_by_key(|f| f.name);
        v
    }

    /// Under a budget, the candidates a first call runs now ([`not_now`]: those whose kernels
    /// are compiled), those it leaves out ([`NOT_COMPILED`]) and their kernel files, which start
    /// compiling in the background; a note names the routes.
    fn runnable_now(
        &self,
        d: Direction,
        p: CudnnPtrs,
        execs: Vec<Exec>,
        budget: &Budget,
        notes: &mut Vec<String>,
    ) -> (Vec<Exec>, Vec<Exec>, Vec<&'static KernelFile>) {
        if budget.exhaustive() || execs.len() < 2 {
            return (execs, Vec::new(), Vec::new());
        }
        let ctx = &self.ctx;
        choice::prepare_first_call_kernels(ctx);
        let files: Vec<Vec<&'static KernelFile>> = execs
            .iter()
            .map(|e| self.route_kernels(d, e, Some(p)))
            .collect();
        let states: Vec<KernelState> = files
            .iter()
            .map(|fs| {
                fs.iter()
                    .map(|f| ctx.kernel_state(f))
                    .find(|s| *s != KernelState::Ready)
                    .unwrap_or(KernelState::Ready)
            })
            .collect();
        let skip = not_now(&states, false);
        let (mut run, mut left) = (Vec::new(), Vec::new());
        let mut waiting: Vec<&'static KernelFile> = Vec::new();
        for ((e, skip), fs) in execs.into_iter().zip(skip).zip(&files) {
            if skip {
                waiting.extend(fs.iter().copied());
                left.push(e);
            } else {
                run.push(e);
            }
        }
        if !left.is_empty() {
            ctx.prepare_kernels(&waiting);
            let labels: Vec<String> = left.iter().map(|e| e.route.label()).collect();
            let n = format!("{NOT_COMPILED}: {}", labels.join(", "));
            tracing::info!(problem = ?self.core.shape, dtype = %self.core.dtype,
                direction = %d, "{n}");
            notes.push(n);
        }
        waiting.sort_by_key(|f| f.name);
        waiting.dedup_by_key(|f| f.name);
        (run, left, waiting)
    }

    /// After a new problem is planned: starts compiling, in the background, what its first
    /// calls under a budget will want (the check's kernels, the reference and every non-cuDNN
    /// candidate's kernels, for aligned operands), so that they are ready as early as possible.
    /// Nothing when no direction has several candidates or the budget is exhaustive.
    pub(super) fn prepare_first_calls(&self) {
        if self.ctx.config().conv_tune_budget_ms == 0 {
            return;
        }
        let mut files: Vec<&'static KernelFile> = Vec::new();
        for d in Direction::ALL {
            let plan = self.plan_for(d);
            if plan.candidates.len() < 2 {
                continue;
            }
            // cuDNN's own routes need no kernel of nnfuse's (the dual path's filter kernel is).
            let own_kernels =
                |r: &&Route| !matches!(r.path, ConvPath::Cudnn | ConvPath::CudnnGraph);
            for r in plan.candidates.iter().filter(own_kernels) {
                if let Ok(e) = self.core.exec_of(&self.ctx, d, *r) {
                    files.extend(self.route_kernels(d, &e, None));
                }
            }
        }
        if files.is_empty() {
            return;
        }
        // Compiles start in this order, a few at a time: the measurement's own kernels, then
        // the candidates' (im2col's, measured in every first call), then the direct f32
        // reference (a check can do without it), then the dual, tiled and filter-gradient paths'.
        // On a fresh H100 the f32 demo's 1x1 layers otherwise decided before im2col compiled
        // (cuDNN's 126 us won over its 93 at conv1's forward).
        let late = [
            &kernels::CONV_DUAL,
            &kernels::CONV_TILED,
            &kernels::CONV_WGRAD,
        ];
        files.sort_by_key(|f| late.iter().any(|l| l.name == f.name));
        let split = files.partition_point(|f| !late.iter().any(|l| l.name == f.name));
        let (early, rest) = files.split_at(split);
        let (reference, measuring): (Vec<_>, Vec<_>) = choice::FIRST_CALL_KERNELS
            .iter()
            .copied()
            .partition(|f| f.name == kernels::CONV_DIRECT.name);
        self.ctx.prepare_kernels(&measuring);
        self.ctx.prepare_kernels(early);
        self.ctx.prepare_kernels(&reference);
        self.ctx.prepare_kernels(rest);
    }

    /// Keeps a costly decision in the process cache and, when configured, in the file.
    pub(super) fn remember(&self, key: &ChoiceKey, c: &ConvChoice) {
        let cfg = self.ctx.config();
        choice::insert(*key, c.clone(), cfg.plan_cache_capacity);
        if let Some(path) = &cfg.tuning_cache {
            let saved = choice::device_tag(&self.ctx)
                .and_then(|tag| choice::save_file(path, &tag, key.device));
            match saved {
                Ok(()) => {
                    tracing::debug!(path = %path.display(), "convolution tuning cache written")
                }
                Err(e) => tracing::warn!(path = %path.display(), error = %e,
                    "convolution tuning cache could not be written; the choice stays in memory"),
            }
        }
    }

    /// The decided route of `d`'s calls that overwrite (`accumulate = false`) or add to their
    /// output, deciding on the first call of that mode.
    pub(super) fn decided(&self, d: Direction, p: CudnnPtrs, accumulate: bool) -> Result<Exec> {
        crate::profile::stage!(Lookup);
        let accumulate = accumulate && d != Direction::Forward;
        let mut st = lock(self.core.decision(d, accumulate));
        if let Some(s) = st.as_mut() {
            if s.pending.is_some() {
                self.settle(d, p, accumulate, s)?;
            }
            return Ok(s.exec);
        }
        let first = if accumulate {
            "a convolution's first accumulating call"
        } else {
            "a convolution's first call"
        };
        self.ctx
            .refuse_under_capture(first, "decide its route (measure)")?;
        // A decision's checks and timings run eagerly (its candidates are thrown away).
        let dec = crate::cudnn_graph::replay::suspended(|| self.decide(d, p, accumulate))?;
        let exec = dec.exec;
        *st = Some(dec);
        Ok(exec)
    }

    /// A provisional decision (`dec.pending`: candidates its first call left out because their
    /// kernels were compiling or the decision budget was spent) measured again once those
    /// kernels are ready: the decided route as the incumbent against the routes left out, the
    /// winner remembered as any measured choice. Until then (still compiling, or the stream
    /// capturing a graph) nothing changes; a failed compile ends the wait. Once per decision,
    /// unless that measurement's budget cut candidates again (then at the next call, at most
    /// [`MAX_SETTLES`] in all): a cold process's first calls keep their budget and its later
    /// calls still get the route the left-out candidates would win.
    fn settle(
        &self,
        d: Direction,
        p: CudnnPtrs,
        accumulate: bool,
        dec: &mut Decided,
    ) -> Result<()> {
        let Some(pending) = dec.pending.as_mut() else {
            return Ok(());
        };
        let epoch = kernels::compile_epoch();
        if epoch == pending.epoch {
            return Ok(()); // no compile finished since the last look
        }
        pending.epoch = epoch;
        match settle_state(pending.files.iter().map(|f| self.ctx.kernel_state(f))) {
            SettleState::Wait => return Ok(()),
            SettleState::Abandon => {
                dec.pending = None;
                return Ok(());
            }
            SettleState::Ready => {}
        }
        if self.ctx.is_capturing()? {
            // Ready, but not measurable now: look again at the next call, compile or not.
            pending.epoch = u64::MAX;
            return Ok(());
        }
        let mut execs = vec![dec.exec];
        execs.extend(pending.execs.iter().copied());
        let more_graph = pending.more_graph;
        let settles = pending.settles + 1;
        dec.pending = None;
        let mut notes = dec.choice.notes.clone();
        if execs.len() > 1 {
            let labels: Vec<String> = execs[1..].iter().map(|e| e.route.label()).collect();
            notes.push(format!(
                "measured again at a later call: {}, left out by the first call (first choice {})",
                labels.join(", "),
                dec.exec.route.label()
            ));
        }
        let plan = self.plan_for(d);
        let ordinal = self.ctx.info().ordinal as u32;
        let key = ChoiceKey::of(ordinal, plan, self.core.search, accumulate);
        let budget = Budget::new(self.ctx.config().conv_tune_budget_ms);
        if more_graph {
            self.add_more_graph_configs(d, plan, accumulate, &budget, &mut execs, &mut notes);
        }
        if execs.len() < 2 {
            return Ok(()); // nothing to measure against the first choice
        }
        let mut settled = crate::cudnn_graph::replay::suspended(|| {
            self.measured(d, p, &key, &execs, notes, budget, &[])
        });
        if settled.choice.origin != ChoiceOrigin::Measured {
            // Nothing could be measured: the first choice stands (it was measured).
            return Ok(());
        }
        // Candidates this measurement's budget cut (a one-time cost such as a first module load
        // can spend it: 129 ms once for a Winograd check, which left a bf16 problem on a 1.4x
        // slower engine config) wait for another later call, a bounded number of times.
        let left = budget_cut(&execs, settled.report.as_deref());
        if settle_again(left.len(), settles) {
            settled.choice.notes.push(format!(
                "{} candidate(s) cut by the decision budget at later measurement {settles}: \
                 measured at the next call",
                left.len()
            ));
            settled.pending = Some(Pending {
                execs: left,
                files: Vec::new(),
                more_graph: false,
                epoch: u64::MAX,
                settles,
            });
        }
        tracing::info!(problem = ?self.core.shape, dtype = %self.core.dtype, direction = %d,
            from = %dec.exec.route, to = %settled.exec.route, candidates = execs.len(),
            more_graph_configs = more_graph,
            "convolution decision settled: the first call's left-out candidates (and, where \
             its graph configs filled the first call's limit, further ones) measured");
        *dec = settled;
        Ok(())
    }

    /// The graph API's engine configs beyond the first call's admission limit, added to `execs`
    /// (which holds the decided route and any left-out candidates) where they can run this
    /// call's mode; a note says how many and how long listing them took.
    fn add_more_graph_configs(
        &self,
        d: Direction,
        plan: &ConvPlan,
        accumulate: bool,
        budget: &Budget,
        execs: &mut Vec<Exec>,
        notes: &mut Vec<String>,
    ) {
        let started = std::time::Instant::now();
        let target = self.core.target(&self.ctx);
        let more = cudnn_graph_run::more_engine_execs(&target, d, execs, budget);
        let (mut more, _) = can_add(plan, more, accumulate, notes);
        notes.extend(choice::drop_uncheckable_f32_graph(
            &mut more,
            self.core.dtype,
        ));
        let ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::debug!(direction = %d, configs = more.len(), ms,
            "cudnn_graph: engine configs past the first call's limit, for a later look");
        if !more.is_empty() {
            notes.push(format!(
                "cudnn_graph: {} engine configs past the first call's {} measured at a later call \
                 (listed and finalized in {ms:.1} ms)",
                more.len(),
                crate::cudnn_graph::notes::GraphLimits::FIRST_CALL.total,
            ));
        }
        execs.extend(more);
    }

    /// A route forced by the caller, completed (engine, cuDNN algorithm) and checked against
    /// the plan.
    pub(super) fn forced(&self, d: Direction, r: Route, p: CudnnPtrs) -> Result<Exec> {
        let plan = self.plan_for(d);
        let info = plan.info(r.path);
        if !info.eligible {
            return Err(Error::NotSupported(format!(
                "{} cannot run this {}: {}",
                r.path,
                d.describe(),
                info.why_not.clone().unwrap_or_default()
            )));
        }
        let mut r = r;
        match r.path {
            ConvPath::Cudnn if r.cudnn_algo.is_none() => {
                let decided = self.core.any_decided_route(d).and_then(|r| r.cudnn_algo);
                let cached = *lock(&self.core.cudnn_first[d.index()]);
                r.cudnn_algo = match decided.or(cached) {
                    Some(a) => Some(a),
                    None => {
                        let first = self
                            .cudnn_execs(d, p, 1)?
                            .0
                            .first()
                            .and_then(|e| e.route.cudnn_algo);
                        *lock(&self.core.cudnn_first[d.index()]) = first;
                        first
                    }
                };
                if r.cudnn_algo.is_none() {
                    return Err(Error::NotSupported(
                        "cuDNN offered no usable algorithm".into(),
                    ));
                }
            }
            ConvPath::CudnnGraph | ConvPath::CudnnTiled
                if r.graph_engine.is_none() && self.core.dtype == DType::F32 =>
            {
                r.graph_engine = Some(self.checked_graph_engine(d, p, r.path)?);
            }
            ConvPath::CudnnDual => self.check_dual_once(d, p, plan)?,
            ConvPath::WinogradF2x3 | ConvPath::WinogradF4x3 if r.engine.is_none() => {
                r.engine = info
                    .winograd
                    .as_ref()
                    .and_then(|w| w.engines.first().copied());
            }
            _ => {}
        }
        if let Some(a) = r.cudnn_algo {
            if a.direction != d || !a.is_known() {
                return Err(Error::invalid(
                    "route",
                    format!("{} is not a cuDNN {} algorithm", a.label(), d),
                ));
            }
        }
        if r.path != ConvPath::Cudnn && r.cudnn_algo.is_some() {
            return Err(Error::invalid(
                "route",
                "only a cuDNN route names a cuDNN algorithm",
            ));
        }
        if r.path.winograd_tile().is_none() && r.engine.is_some() {
            return Err(Error::invalid(
                "route",
                "only a Winograd route names an engine",
            ));
        }
        if let Some(e) = cudnn_graph_run::misplaced(&r) {
            return Err(e);
        }
        self.core.exec_of(&self.ctx, d, r)
    }

    /// The input of a measurement of direction `d` of this problem: `execs` in measuring order
    /// on operands `p`, under `budget`, run overwriting or (`accumulate`) adding.
    fn measure_input<'a>(
        &'a self,
        d: Direction,
        execs: &'a [Exec],
        p: CudnnPtrs,
        budget: Budget,
        direct_reference: bool,
        accumulate: bool,
    ) -> MeasureInput<'a> {
        MeasureInput {
            ctx: &self.ctx,
            shape: &self.core.shape,
            dtype: self.core.dtype,
            direction: d,
            cudnn: self.core.cudnn.as_deref(),
            execs,
            operands: p,
            lens: self.core.lens,
            budget,
            direct_reference,
            accumulate,
        }
    }

    /// cuDNN's first legacy algorithm, measured beside a graph listing that finalized fewer
    /// than 2 engine configs (`graph_configs`): with one config there is nothing to compare, and
    /// on the H100 a lone heuristic config ran the ResNet-50 stem's forward at 191 µs where the
    /// legacy IMPLICIT_PRECOMP_GEMM took 89. Its host cost (50-120 µs per call) does not count:
    /// the measurement times GPU work only.
    fn legacy_companion(
        &self,
        d: Direction,
        p: CudnnPtrs,
        graph_configs: usize,
        notes: &mut Vec<String>,
    ) -> Vec<Exec> {
        match self.cudnn_execs(d, p, 1) {
            Ok((v, _, _)) if !v.is_empty() => {
                notes.push(format!(
                    "{graph_configs} graph engine config(s) finalized: cuDNN's first legacy \
                     algorithm is measured beside"
                ));
                v.into_iter().take(1).collect()
            }
            Ok(_) => Vec::new(),
            Err(e) => {
                notes.push(format!("cuDNN's legacy algorithms: {e}"));
                Vec::new()
            }
        }
    }

    /// A true-f32 route to run beside f32 graph engine configs, the reference they are held to:
    /// cuDNN's first usable legacy algorithm (FMA math), else the plan's im2col + GEMM when
    /// eligible; none (said in `notes`) when neither can be completed.
    fn true_f32_companion(&self, d: Direction, p: CudnnPtrs, notes: &mut Vec<String>) -> Vec<Exec> {
        let legacy = match self.cudnn_execs(d, p, 1) {
            Ok((v, _, _)) => v.into_iter().take(1).collect::<Vec<_>>(),
            Err(e) => {
                notes.push(format!("f32: cuDNN's legacy algorithms: {e}"));
                Vec::new()
            }
        };
        if !legacy.is_empty() {
            notes.push(
                "f32: cuDNN's first legacy algorithm (FMA math, true f32) is measured beside \
                 the graph engine configs, which are held to it"
                    .into(),
            );
            return legacy;
        }
        let im2col = Route::path(ConvPath::Im2colGemm);
        if self.plan_for(d).eligible(ConvPath::Im2colGemm) {
            if let Ok(e) = self.core.exec_of(&self.ctx, d, im2col) {
                return vec![e];
            }
        }
        Vec::new()
    }

    /// A forced `cudnn_dual` route's first call: the route checked against a true-f32 route
    /// ([`Self::verified`]; its data gradient runs a graph engine config, whose notes do not
    /// prove true f32), remembered once it passes. An error when it does not.
    fn check_dual_once(&self, d: Direction, p: CudnnPtrs, plan: &ConvPlan) -> Result<()> {
        if self
            .core
            .dual_checked
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return Ok(());
        }
        self.ctx.refuse_under_capture(
            "a forced cudnn_dual route's first call",
            "check it against a true-f32 route",
        )?;
        let exec = self
            .core
            .exec_of(&self.ctx, d, Route::path(ConvPath::CudnnDual))?;
        match self.verified(d, p, plan, exec, false) {
            Ok(_) => {
                self.core
                    .dual_checked
                    .store(true, std::sync::atomic::Ordering::Release);
                Ok(())
            }
            Err(line) => Err(Error::NotSupported(format!(
                "cudnn_dual failed its check against a true-f32 route for this forward{}",
                line.map(|l| format!(": relative L2 error {:?}, {:?}", l.rel_l2, l.outcome))
                    .unwrap_or_default()
            ))),
        }
    }

    /// The engine config a forced f32 `cudnn_graph` (or `cudnn_tiled`: its tiled problem's)
    /// route without one runs: the decided route's when it is a route of `path` (it passed the
    /// check), else the first admitted config that passes the check against a true-f32 route
    /// ([`choice::verify`]; remembered per direction, or for the tiled filter gradient). An
    /// error when none passes: a forced f32 graph route never runs unchecked.
    fn checked_graph_engine(
        &self,
        d: Direction,
        p: CudnnPtrs,
        path: ConvPath,
    ) -> Result<GraphEngine> {
        let tiled = path == ConvPath::CudnnTiled;
        let slot = if tiled {
            &self.core.tiled_first
        } else {
            &self.core.graph_first[d.index()]
        };
        let decided = self
            .core
            .any_decided_route(d)
            .filter(|r| r.path == path)
            .and_then(|r| r.graph_engine);
        if let Some(e) = decided.or(*lock(slot)) {
            return Ok(e);
        }
        self.ctx.refuse_under_capture(
            "a forced f32 cudnn_graph or cudnn_tiled route's first call",
            "check its engine configs against a true-f32 route",
        )?;
        let budget = Budget::new(self.ctx.config().conv_tune_budget_ms);
        let mut notes = Vec::new();
        let target = self.core.target(&self.ctx);
        let mut execs = if tiled {
            super::conv_tiled::engine_execs(&target, &budget, &mut notes)
        } else {
            cudnn_graph_run::engine_execs(&target, d, &budget, &mut notes)
        };
        if execs.is_empty() {
            return Err(Error::NotSupported(format!(
                "no cuDNN graph engine config finalizes for this f32 {}: {}",
                d.describe(),
                notes.join("; ")
            )));
        }
        execs.extend(self.true_f32_companion(d, p, &mut notes));
        let inp = self.measure_input(d, &execs, p, budget, true, false);
        let (_, report) = choice::verify(&inp)?;
        let passed = report
            .candidates
            .iter()
            .find(|c| c.outcome == Outcome::Passed && c.route.graph_engine.is_some())
            .and_then(|c| c.route.graph_engine);
        let Some(engine) = passed else {
            return Err(Error::NotSupported(format!(
                "no engine config of cuDNN's graph API passed the true-f32 check for this f32 \
                 {}:\n{report}",
                d.describe()
            )));
        };
        tracing::info!(problem = ?self.core.shape, direction = %d, path = %path, engine = %engine,
            "forced f32 graph route: engine config checked against a true-f32 route:\n{report}");
        *lock(slot) = Some(engine);
        Ok(engine)
    }

    /// Runs `d` on checked operands: the forced route, or the decided one of the call's mode
    /// (overwriting or accumulating: each decided on its own first call) with a fallback when
    /// it fails at run time. An accumulating call (a gradient added to its output) runs only a
    /// route that can add ([`ConvPlan::accumulate_refusal`]): a forced one that cannot is an
    /// error; the accumulating decision is made among those that can.
    pub(super) fn run(
        &self,
        d: Direction,
        p: CudnnPtrs,
        accumulate: bool,
        forced: Option<Route>,
    ) -> Result<()> {
        let accumulate = accumulate && d != Direction::Forward;
        let plan = self.plan_for(d);
        if !plan.runnable {
            return Err(Error::NotSupported(format!(
                "no path can compute this {}: {}",
                d.describe(),
                plan.reasons.join("; ")
            )));
        }
        let target = self.core.target(&self.ctx);
        if let Some(r) = forced {
            if let Some(why) = plan.accumulate_refusal(r.path).filter(|_| accumulate) {
                return Err(Error::NotSupported(format!(
                    "{} cannot run this accumulating {}: {why}",
                    r.path,
                    d.describe()
                )));
            }
            let e = self.forced(d, r, p)?;
            tracing::debug!(direction = %d, route = %e.route, "convolution (forced route)");
            // SAFETY: operands checked by `check`; the route was checked against the plan.
            return unsafe { route::run(&target, d, e, p, accumulate) };
        }
        let e = self.decided(d, p, accumulate)?;
        // The accumulating decision is made among routes that can add; checked again here (one
        // comparison) so that no route ever overwrites a gradient it was asked to add to.
        if let Some(why) = plan.accumulate_refusal(e.route.path).filter(|_| accumulate) {
            return Err(Error::NotSupported(format!(
                "the decided route {} cannot run this accumulating {}: {why}",
                e.route,
                d.describe()
            )));
        }
        tracing::trace!(direction = %d, accumulate, route = %e.route, "convolution");
        // SAFETY: as above.
        let first = unsafe { route::run(&target, d, e, p, accumulate) };
        #[cfg(test)]
        let first = first.and_then(|()| injected_failure());
        let Err(err) = first else {
            return Ok(());
        };
        let Some(fb_exec) = self.fall_back(d, plan, e, &err, p, accumulate)? else {
            return Err(err);
        };
        if accumulate {
            // The failed route may have added part (or all) of the gradient to the output
            // already; a second run would add it again. Later calls take the fallback.
            let out = if d == Direction::BackwardData {
                "dx"
            } else {
                "dw"
            };
            return Err(Error::NotSupported(format!(
                "the {}'s route {} failed at run time ({err}); {out} may be partly updated, so \
                 this accumulating call is not re-run on the fallback {} (later calls take it)",
                d.describe(),
                e.route,
                fb_exec.route
            )));
        }
        // SAFETY: as above.
        unsafe { route::run(&target, d, fb_exec, p, accumulate) }
    }

    /// Accumulating calls of `d` when no candidate can add (`cannot_add`: each with why; a
    /// plan of Winograd routes only, whose data gradient has no beta): the plan's fallback
    /// (cuDNN's first usable algorithm, else im2col + GEMM), unmeasured; the notes say why.
    fn adding_fallback(
        &self,
        d: Direction,
        p: CudnnPtrs,
        plan: &ConvPlan,
        cannot_add: &[(Route, String)],
        mut notes: Vec<String>,
    ) -> Result<Decided> {
        let refused = cannot_add.first().map_or(ConvPath::Cudnn, |(r, _)| r.path);
        let mut exec = None;
        for r in [
            plan.fallback_route(refused),
            plan.fallback_route(ConvPath::Cudnn),
        ]
        .into_iter()
        .flatten()
        .filter(|r| plan.accumulate_refusal(r.path).is_none())
        {
            exec = self.complete(d, r, p)?;
            if exec.is_some() {
                break;
            }
        }
        let labels: Vec<String> = cannot_add.iter().map(|(r, _)| r.label()).collect();
        let why = cannot_add.first().map_or("", |(_, w)| w.as_str());
        let Some(exec) = exec else {
            return Err(Error::NotSupported(format!(
                "{} cannot add to this {}'s output ({why}), and no other route can run it",
                labels.join(", "),
                d.describe()
            )));
        };
        let note = format!(
            "accumulating calls run {} (the plan's fallback): {} {why}",
            exec.route,
            labels.join(", ")
        );
        tracing::info!(problem = ?self.core.shape, direction = %d, route = %exec.route,
            "{note}");
        notes.push(note);
        let mut c = ConvChoice::planned(exec.route, ChoiceOrigin::Planned);
        c.notes = notes;
        Ok(Decided {
            exec,
            choice: c,
            report: None,
            pending: None,
        })
    }

    /// Route `r` of `d` completed: a cuDNN route without an algorithm takes cuDNN's first
    /// usable one; `None` when cuDNN offers none.
    fn complete(&self, d: Direction, r: Route, p: CudnnPtrs) -> Result<Option<Exec>> {
        match (r.path, r.cudnn_algo) {
            (ConvPath::Cudnn, None) => match self.cudnn_execs(d, p, 1) {
                Ok((v, _, _)) => Ok(v.first().copied()),
                Err(_) => Ok(None),
            },
            _ => self.core.exec_of(&self.ctx, d, r).map(Some),
        }
    }

    /// After `e`, the decided route of `d`'s calls of mode `accumulate`, failed at run time
    /// with `err`: the plan's fallback for it, completed and remembered (this object, and the
    /// process cache so that other Contexts take it too; never the file), or `None` when there
    /// is none. The other mode's decision takes it too when it is the same route (the failure
    /// is the route's on this problem, whichever mode ran it).
    fn fall_back(
        &self,
        d: Direction,
        plan: &ConvPlan,
        e: Exec,
        err: &Error,
        p: CudnnPtrs,
        accumulate: bool,
    ) -> Result<Option<Exec>> {
        let core = &*self.core;
        let Some(fb) = plan.fallback_route(e.route.path) else {
            return Ok(None);
        };
        let Some(fb_exec) = self.complete(d, fb, p)? else {
            return Ok(None);
        };
        tracing::warn!(
            problem = ?core.shape, dtype = %core.dtype, direction = %d, accumulate,
            failed = %e.route, fallback = %fb_exec.route, error = %err,
            "convolution route failed at run time; this problem uses the fallback from now on"
        );
        let mut c = ConvChoice::planned(fb_exec.route, ChoiceOrigin::Fallback);
        c.notes
            .push(format!("{} failed at run time: {err}", e.route));
        let modes: &[bool] = if d == Direction::Forward {
            &[false]
        } else {
            &[accumulate, !accumulate]
        };
        for &mode in modes {
            let mut slot = lock(core.decision(d, mode));
            if mode != accumulate && slot.as_ref().is_none_or(|s| s.exec.route != e.route) {
                continue;
            }
            let key = ChoiceKey::of(self.ctx.info().ordinal as u32, plan, core.search, mode);
            choice::insert(key, c.clone(), self.ctx.config().plan_cache_capacity);
            *slot = Some(Decided {
                exec: fb_exec,
                choice: c.clone(),
                report: None,
                pending: None,
            });
        }
        Ok(Some(fb_exec))
    }
}

/// For a decision of accumulating calls (`accumulate`), `execs` without the routes that cannot
/// add to the output, and those (each with why, a note naming them); all of `execs` otherwise.
/// The candidates of `execs` (those a measurement was given) that its report skipped: the
/// decision budget was spent before they were checked.
fn budget_cut(execs: &[Exec], report: Option<&AutoReport>) -> Vec<Exec> {
    let Some(r) = report else {
        return Vec::new();
    };
    r.candidates
        .iter()
        .filter(|c| matches!(c.outcome, Outcome::Skipped(_)))
        .filter_map(|c| execs.iter().find(|e| e.route == c.route).copied())
        .collect()
}

/// Whether a later measurement that left `cut` candidates unmeasured for its budget, the
/// `settles`-th for its decision, is followed by another one. Pure.
fn settle_again(cut: usize, settles: u8) -> bool {
    cut > 0 && settles < MAX_SETTLES
}

/// Whether a provisional decision can be measured again ([`SettleState`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SettleState {
    /// Every kernel file it waits for is ready.
    Ready,
    /// Some are still compiling (or queued to).
    Wait,
    /// A compile failed or was never started: the decision stays as it is.
    Abandon,
}

/// The [`SettleState`] of a provisional decision from its kernel files' states. Pure.
fn settle_state(states: impl IntoIterator<Item = KernelState>) -> SettleState {
    let mut out = SettleState::Ready;
    for s in states {
        match s {
            KernelState::Ready => {}
            KernelState::Compiling => out = SettleState::Wait,
            KernelState::Failed(_) | KernelState::Missing => return SettleState::Abandon,
        }
    }
    out
}

fn can_add(
    plan: &ConvPlan,
    execs: Vec<Exec>,
    accumulate: bool,
    notes: &mut Vec<String>,
) -> (Vec<Exec>, Vec<(Route, String)>) {
    if !accumulate {
        return (execs, Vec::new());
    }
    let (mut keep, mut out) = (Vec::new(), Vec::new());
    for e in execs {
        match plan.accumulate_refusal(e.route.path) {
            Some(why) => out.push((e.route, format!("cannot add: {why}"))),
            None => keep.push(e),
        }
    }
    if !out.is_empty() {
        let labels: Vec<String> = out.iter().map(|(r, _)| r.label()).collect();
        notes.push(format!(
            "accumulating calls: {} not measured (cannot add to the output)",
            labels.join(", ")
        ));
    }
    (keep, out)
}

#[cfg(test)]
thread_local! {
    /// Test hook: makes the next decided route's run on this thread report a failure after it
    /// ran (as an error surfacing behind work already queued would), so that the run-time
    /// fallback can be tested. Per thread: tests run in parallel.
    pub(crate) static FAIL_NEXT_RUN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(test)]
fn injected_failure() -> Result<()> {
    if FAIL_NEXT_RUN.with(|f| f.replace(false)) {
        return Err(Error::NotSupported(
            "injected run-time failure (test)".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::FAIL_NEXT_RUN;
    use super::{settle_again, settle_state, SettleState, MAX_SETTLES};
    use crate::conv::im2col::gpu_tests::{check, download, quantized, upload};
    use crate::conv::{ChoiceOrigin, Conv2d, ConvPath, Direction};
    use crate::kernels::KernelState;
    use crate::layout::TensorFormat;
    use crate::testutil::{gpu_with, Rng};
    use crate::{Config, ConvAlgoPolicy, Error};

    #[test]
    fn a_later_measurement_cut_by_its_budget_is_followed_by_another_a_bounded_number_of_times() {
        assert!(!settle_again(0, 1), "nothing cut: done");
        assert!(settle_again(4, 1));
        assert!(settle_again(1, MAX_SETTLES - 1));
        assert!(!settle_again(4, MAX_SETTLES), "bounded");
    }

    #[test]
    fn a_provisional_decision_waits_for_every_file_and_gives_up_on_a_failed_one() {
        use KernelState::{Compiling, Failed, Missing, Ready};
        assert_eq!(settle_state([Ready, Ready]), SettleState::Ready);
        assert_eq!(settle_state([]), SettleState::Ready);
        assert_eq!(settle_state([Ready, Compiling]), SettleState::Wait);
        assert_eq!(
            settle_state([Compiling, Failed("nvrtc".into())]),
            SettleState::Abandon
        );
        assert_eq!(settle_state([Missing, Ready]), SettleState::Abandon);
    }

    /// A filter gradient that accumulates into dw on a chunked im2col route which fails at run
    /// time (after adding its chunks) is not re-run on the fallback: the call errors saying dw
    /// may be partly updated, dw holds the gradient added once, and later calls take the
    /// fallback. A call that overwrites is re-run on the fallback as before.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn a_failed_accumulating_filter_gradient_is_not_added_twice() {
        let config = Config {
            conv_algo: ConvAlgoPolicy::Im2col,
            conv_workspace_mb: 1,
            ..Config::default()
        };
        let ctx = gpu_with(config);
        // NCHW, one image's columns (16*9 x 32*32 f32, 576 KiB) per 1 MiB chunk: 7 chunks.
        let s = crate::testutil::square_conv(7, 16, 32, 24, 3, TensorFormat::Nchw);
        let conv = Conv2d::<f32>::new(&ctx, &s).unwrap();
        let plan = conv.plan_for(Direction::BackwardFilter);
        assert_eq!(plan.path, ConvPath::Im2colGemm, "{plan}");
        assert!(plan.info(ConvPath::Im2colGemm).chunks > 1, "{plan}");
        if plan.fallback_route(ConvPath::Im2colGemm).is_none() {
            println!("no cuDNN: im2col has no fallback here, nothing to test");
            return;
        }
        let mut rng = Rng::fresh("a_failed_accumulating_filter_gradient_is_not_added_twice");
        let x = upload::<f32>(&ctx, &quantized(&mut rng, s.x_len().unwrap()));
        let dy = upload::<f32>(&ctx, &quantized(&mut rng, s.y_len().unwrap()));
        let dw0 = quantized(&mut rng, s.w_len().unwrap());
        let mut g = upload::<f32>(&ctx, &dw0);
        conv.backward_filter(&x, &dy, &mut g, false).unwrap();
        let g = download(&ctx, &g);
        let once: Vec<f64> = dw0.iter().zip(&g).map(|(a, b)| a + b).collect();

        let mut dw = upload::<f32>(&ctx, &dw0);
        FAIL_NEXT_RUN.with(|f| f.set(true));
        let e = conv.backward_filter(&x, &dy, &mut dw, true).unwrap_err();
        assert!(
            matches!(e, Error::NotSupported(_)) && e.to_string().contains("partly updated"),
            "{e}"
        );
        check(
            "dw after the failed call",
            &download(&ctx, &dw),
            &once,
            1e-5,
        );
        let c = conv.choice(Direction::BackwardFilter).unwrap();
        assert_eq!(
            (c.route.path, c.origin),
            (ConvPath::Cudnn, ChoiceOrigin::Fallback)
        );
        // The fallback runs the next call.
        conv.backward_filter(&x, &dy, &mut dw, true).unwrap();
        let twice: Vec<f64> = once.iter().zip(&g).map(|(a, b)| a + b).collect();
        check("dw after the next call", &download(&ctx, &dw), &twice, 1e-5);

        // Overwriting: the fallback (im2col again, after cuDNN) re-runs the call.
        let mut dw = upload::<f32>(&ctx, &dw0);
        FAIL_NEXT_RUN.with(|f| f.set(true));
        conv.backward_filter(&x, &dy, &mut dw, false).unwrap();
        check(
            "dw overwritten on the fallback",
            &download(&ctx, &dw),
            &g,
            1e-5,
        );
    }

    /// The data gradient likewise: an accumulating call on a chunked im2col route (col2im adds
    /// chunk by chunk) that fails at run time is not re-run on the fallback: dx holds the
    /// gradient added once, the error says dx may be partly updated, and the next accumulating
    /// call runs the fallback and adds it once more.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn a_failed_accumulating_data_gradient_is_not_added_twice() {
        let config = Config {
            conv_algo: ConvAlgoPolicy::Im2col,
            conv_workspace_mb: 1,
            ..Config::default()
        };
        let ctx = gpu_with(config);
        let s = crate::testutil::square_conv(7, 16, 32, 24, 3, TensorFormat::Nchw);
        let conv = Conv2d::<f32>::new(&ctx, &s).unwrap();
        let plan = conv.plan_for(Direction::BackwardData);
        assert_eq!(plan.path, ConvPath::Im2colGemm, "{plan}");
        assert!(plan.info(ConvPath::Im2colGemm).chunks > 1, "{plan}");
        if plan.fallback_route(ConvPath::Im2colGemm).is_none() {
            println!("no cuDNN: im2col has no fallback here, nothing to test");
            return;
        }
        let mut rng = Rng::fresh("a_failed_accumulating_data_gradient_is_not_added_twice");
        let w = upload::<f32>(&ctx, &quantized(&mut rng, s.w_len().unwrap()));
        let dy = upload::<f32>(&ctx, &quantized(&mut rng, s.y_len().unwrap()));
        let dx0 = quantized(&mut rng, s.x_len().unwrap());
        let mut g = upload::<f32>(&ctx, &dx0);
        conv.backward_data(&dy, &w, &mut g).unwrap();
        let g = download(&ctx, &g);
        let once: Vec<f64> = dx0.iter().zip(&g).map(|(a, b)| a + b).collect();

        let mut dx = upload::<f32>(&ctx, &dx0);
        FAIL_NEXT_RUN.with(|f| f.set(true));
        let e = conv.backward_data_into(&dy, &w, &mut dx, true).unwrap_err();
        assert!(
            matches!(e, Error::NotSupported(_))
                && e.to_string().contains("dx may be partly updated"),
            "{e}"
        );
        check(
            "dx after the failed call",
            &download(&ctx, &dx),
            &once,
            1e-5,
        );
        let c = conv.choice(Direction::BackwardData).unwrap();
        assert_eq!(
            (c.route.path, c.origin),
            (ConvPath::Cudnn, ChoiceOrigin::Fallback)
        );
        conv.backward_data_into(&dy, &w, &mut dx, true).unwrap();
        let twice: Vec<f64> = once.iter().zip(&g).map(|(a, b)| a + b).collect();
        check("dx after the next call", &download(&ctx, &dx), &twice, 1e-5);
    }
}
