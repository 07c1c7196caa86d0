//! [`ConvBnTrain`]'s backward routes: composed (the BatchNorm's backward into dz, then the
//! convolution's two gradients of dz) or folded (`fold_backward.rs`: dz never written), and the
//! first backward's decision between them — the composed route into the caller's buffers, the
//! folded one into NaN-poisoned buffers of its own checked against it, then both timed (GPU
//! time, interleaved rounds behind a head start) and the incumbent rule.

use cudarc::driver::{CudaSlice, DevicePtr};

use super::api::lock;
use super::check::{passes, tolerance};
use super::fold_backward::FoldOperands;
use super::train::{ConvBnBackwardArgs, ConvBnTrain};
use super::train_decide::{rel_l2, two_way_verdict, RACE};
use super::train_plan::{FoldChoice, TrainRoute};
use crate::device_check::compare_on_device;
use crate::dtype::Element;
use crate::error::{CallExt, Error, Result};
use crate::timing::time_interleaved_gpu;
use crate::validate::{Aliasing, Binder, Need};

/// The probe's outputs of one backward.
struct Probe<T> {
    dz: CudaSlice<T>,
    dx: Option<CudaSlice<T>>,
    dw: CudaSlice<T>,
    dgamma: CudaSlice<f32>,
    dbeta: CudaSlice<f32>,
    d_addend: CudaSlice<T>,
}

impl<T: Element> ConvBnTrain<T> {
    /// Why the fold cannot run this call (the unit's plan, or a forward state not from the
    /// fused route's own BatchNorm), or `None`.
    pub(super) fn fold_blocked(&self, a: &ConvBnBackwardArgs<'_, T>) -> Option<String> {
        if let Some(why) = &self.fold_why {
            return Some(why.clone());
        }
        if a.saved.route != TrainRoute::Fused
            || !self.fused.as_ref().is_some_and(|f| f.bn.owns(&a.saved.bn))
        {
            return Some(
                "the forward ran the unfused route (its BatchNorm state is not the own path's)"
                    .into(),
            );
        }
        let (Some(fold), Some(d)) = (&self.fold, &a.d_addend) else {
            return Some("d_addend is required for Fuse::AddRelu".into());
        };
        let s = self.ctx.stream();
        fold.refusal([
            a.dy.device_ptr(s).0,
            d.device_ptr(s).0,
            a.x.device_ptr(s).0,
            a.w.device_ptr(s).0,
        ])
    }

    /// Why this unit's backward cannot fold (None: it can, where the forward ran the fused
    /// route).
    pub fn fold_refusal(&self) -> Option<&str> {
        self.fold_why.as_deref()
    }

    /// The backward's decision (None before a first backward the fold could run).
    pub fn backward_folds(&self) -> Option<bool> {
        lock(&self.fold_choice).as_ref().map(|c| c.folded)
    }

    /// How the folded backward makes G = gᵀx and H = xᵀx: `"sums pass (tensor cores)"` (f16
    /// and bf16, 64 input channels, output channels a multiple of 256) or `"cuBLAS"`; None
    /// where the unit cannot fold.
    pub fn fold_products(&self) -> Option<&'static str> {
        self.fold.as_ref().map(|f| f.products_route())
    }

    /// The backward's decision in one sentence, or why the fold does not apply.
    pub fn backward_decision(&self) -> String {
        match (&*lock(&self.fold_choice), &self.fold_why) {
            (Some(c), _) if c.folded => match self.fold_products() {
                Some(p) => format!("{}; G and H: {p}", c.describe()),
                None => c.describe(),
            },
            (Some(c), _) => c.describe(),
            (None, Some(why)) => format!("backward composed: no fold: {why}"),
            (None, None) => "backward not decided yet (the fold is eligible)".into(),
        }
    }

    /// The backward on the route given (`folded`); the fold where it cannot run is an error
    /// saying why.
    pub fn backward_with(&self, folded: bool, a: ConvBnBackwardArgs<'_, T>) -> Result<()> {
        if !folded {
            return self.backward_composed(a);
        }
        if let Some(why) = self.fold_blocked(&a) {
            return Err(Error::NotSupported(format!(
                "the folded backward cannot run: {why}"
            )));
        }
        self.backward_folded(a)
    }

    /// The folded route: every operand checked, then `fold_backward.rs`.
    pub(super) fn backward_folded(&self, a: ConvBnBackwardArgs<'_, T>) -> Result<()> {
        let Some(fold) = &self.fold else {
            return Err(Error::NotSupported(
                "the unit has no folded backward".into(),
            ));
        };
        self.check_fold_operands(&a)?;
        let Some(d_addend) = a.d_addend else {
            return Err(Error::invalid("d_addend", "required for Fuse::AddRelu"));
        };
        fold.run(
            &self.conv,
            FoldOperands {
                x: a.x,
                w: a.w,
                z: a.z,
                dy: a.dy,
                gamma: a.gamma,
                saved: &a.saved.bn,
                dx: a.dx,
                accumulate_dx: a.accumulate_dx,
                dw: a.dw,
                dgamma: a.dgamma,
                dbeta: a.dbeta,
                d_addend,
            },
        )
    }

    /// Lengths of the operands the fold's own kernels touch, and no output overlapping any
    /// operand (the BatchNorm and the convolution check their own again).
    fn check_fold_operands(&self, a: &ConvBnBackwardArgs<'_, T>) -> Result<()> {
        let s = &self.plan.shape;
        let (xn, wn, yn) = (s.x_len()?, s.w_len()?, s.y_len()?);
        let c = s.c_out;
        let mut ops = Binder::new(&self.ctx);
        ops.input("x", &a.x, Need::Exactly(xn, "the unit's shape"))?;
        ops.input("w", &a.w, Need::Exactly(wn, "the unit's shape"))?;
        ops.input("z", &a.z, Need::Exactly(yn, "the unit's shape"))?;
        ops.input("y", &a.y, Need::Exactly(yn, "the unit's shape"))?;
        ops.input("dy", &a.dy, Need::Exactly(yn, "the unit's shape"))?;
        ops.input("gamma", &a.gamma, Need::Exactly(c, "c_out"))?;
        ops.input("beta", &a.beta, Need::Exactly(c, "c_out"))?;
        ops.output_ref("dz", &a.dz, Need::Exactly(yn, "the unit's shape"))?;
        if let Some(dx) = &a.dx {
            ops.output_ref("dx", dx, Need::Exactly(xn, "the unit's shape"))?;
        }
        ops.output_ref("dw", &a.dw, Need::Exactly(wn, "the unit's shape"))?;
        ops.output_ref("dgamma", &a.dgamma, Need::Exactly(c, "c_out"))?;
        ops.output_ref("dbeta", &a.dbeta, Need::Exactly(c, "c_out"))?;
        if let Some(d) = &a.d_addend {
            ops.output_ref("d_addend", d, Need::Exactly(yn, "the unit's shape"))?;
        }
        ops.check(Aliasing::Distinct).map(|_| ())
    }

    /// The first backward the fold could run: composed into the caller's buffers, the fold
    /// checked against it and both timed (see the module documentation).
    pub(super) fn decide_backward(&self, mut a: ConvBnBackwardArgs<'_, T>) -> Result<()> {
        self.ctx.refuse_under_capture(
            "the first backward of a conv+BN training unit",
            "measure its routes (make the first backward outside capture)",
        )?;
        let s = self.ctx.stream();
        let alloc = |len: usize| -> Result<CudaSlice<T>> {
            // SAFETY: written (poisoned first where compared) before anything reads them.
            unsafe { s.alloc::<T>(len.max(1)) }.call("cuMemAllocAsync")
        };
        let c = a.gamma.len().max(1);
        let mut p = Probe {
            dz: alloc(a.dz.len())?,
            // The same starting dx when the call accumulates.
            dx: match &a.dx {
                Some(dx) if a.accumulate_dx => Some(s.clone_dtod(dx).call("cuMemcpyDtoD")?),
                Some(dx) => Some(alloc(dx.len())?),
                None => None,
            },
            dw: alloc(a.dw.len())?,
            dgamma: s.alloc_zeros::<f32>(c).call("cuMemAllocAsync")?,
            dbeta: s.alloc_zeros::<f32>(c).call("cuMemAllocAsync")?,
            d_addend: alloc(a.dz.len())?,
        };
        self.backward_composed(reborrow(&mut a))?;
        let mut notes = Vec::new();
        match self.check_fold(&mut a, &mut p) {
            Ok(line) => notes.push(format!("folded: matches composed: {line}")),
            Err(why) => {
                notes.push(format!("folded: not taken: {why}"));
                self.record_fold(false, Vec::new(), notes);
                return Ok(());
            }
        }
        let timed = time_interleaved_gpu(&self.ctx, RACE, 2, |v, _| {
            let args = probe_args(&a, &mut p);
            if v == 0 {
                self.backward_composed(args)
            } else {
                self.backward_folded(args)
            }
        })?;
        let names = ["composed", "folded"];
        let (times, wins) = two_way_verdict(&timed, names, names, &mut notes);
        self.record_fold(wins, times, notes);
        Ok(())
    }

    /// Runs the fold into the poisoned probe and compares every output with the composed
    /// route's in the caller's buffers: a line saying what passed, or why not.
    fn check_fold(
        &self,
        a: &mut ConvBnBackwardArgs<'_, T>,
        p: &mut Probe<T>,
    ) -> std::result::Result<String, String> {
        let dt = T::DTYPE;
        let nan = T::from_f64(f64::NAN);
        let mut run = || -> Result<Vec<(&'static str, f64, f64)>> {
            let ctx = &self.ctx;
            if !a.accumulate_dx {
                if let Some(dx) = p.dx.as_mut() {
                    crate::util::fill(ctx, dx, nan)?;
                }
            }
            crate::util::fill(ctx, &mut p.dw, nan)?;
            crate::util::fill(ctx, &mut p.d_addend, nan)?;
            self.backward_folded(probe_args(a, p))?;
            let mut out = Vec::new();
            if let (Some(want), Some(got)) = (&a.dx, &p.dx) {
                let (rel, bad) = compare_on_device(ctx, want, got, "the composed dx")?;
                out.push(("dx", rel, bad));
            }
            let (rel, bad) = compare_on_device(ctx, &a.dw, &p.dw, "the composed dw")?;
            out.push(("dw", rel, bad));
            if let Some(want) = &a.d_addend {
                let (rel, bad) =
                    compare_on_device(ctx, want, &p.d_addend, "the composed d_addend")?;
                out.push(("d_addend", rel, bad));
            }
            let s = ctx.stream();
            for (name, want, got) in [
                ("dgamma", &a.dgamma, &p.dgamma),
                ("dbeta", &a.dbeta, &p.dbeta),
            ] {
                let w = s.clone_dtoh(want).call("cuMemcpyDtoH")?;
                let g = s.clone_dtoh(got).call("cuMemcpyDtoH")?;
                out.push((name, rel_l2(&w, &g), 0.0));
            }
            Ok(out)
        };
        let out = run().map_err(|e| format!("it failed: {e}"))?;
        let line = out
            .iter()
            .map(|(n, rel, bad)| format!("{n} {rel:.2e} ({bad} non-finite)"))
            .collect::<Vec<_>>()
            .join(", ");
        // Each route may be the type's tolerance away from the exact result, so the two may
        // differ by twice it: the composed dw carries dz rounded to the type (bf16: 2^-9 an
        // element), which grows against dW with the rows, the folded one does not (G in f32);
        // at batch 32 with bf16 they differed by 3.9e-3 to 1.0e-2 while both were 1.7e-3 from
        // f64 at batch 2.
        let line = format!("relative L2 {line} (bound {:.0e})", 2.0 * tolerance(dt));
        if out.iter().all(|&(_, rel, bad)| passes(rel / 2.0, bad, dt)) {
            Ok(line)
        } else {
            Err(format!("it differs from composed: {line}"))
        }
    }

    fn record_fold(&self, folded: bool, times_us: Vec<(&'static str, f64)>, notes: Vec<String>) {
        tracing::info!(
            folded,
            ?times_us,
            ?notes,
            "conv+BN training unit's backward decided"
        );
        *lock(&self.fold_choice) = Some(FoldChoice {
            folded,
            times_us,
            notes,
        });
    }
}

/// The call's operands again, borrowed for one more run.
fn reborrow<'s, T>(a: &'s mut ConvBnBackwardArgs<'_, T>) -> ConvBnBackwardArgs<'s, T> {
    ConvBnBackwardArgs {
        x: a.x.slice(..),
        w: a.w.slice(..),
        z: a.z.slice(..),
        y: a.y.slice(..),
        dy: a.dy.slice(..),
        gamma: a.gamma.slice(..),
        beta: a.beta.slice(..),
        saved: a.saved,
        dz: a.dz.slice_mut(..),
        dx: a.dx.as_mut().map(|d| d.slice_mut(..)),
        accumulate_dx: a.accumulate_dx,
        dw: a.dw.slice_mut(..),
        dgamma: a.dgamma.slice_mut(..),
        dbeta: a.dbeta.slice_mut(..),
        d_addend: a.d_addend.as_mut().map(|d| d.slice_mut(..)),
    }
}

/// The caller's inputs with the probe's outputs.
fn probe_args<'s, T>(
    a: &'s ConvBnBackwardArgs<'_, T>,
    p: &'s mut Probe<T>,
) -> ConvBnBackwardArgs<'s, T> {
    ConvBnBackwardArgs {
        x: a.x.slice(..),
        w: a.w.slice(..),
        z: a.z.slice(..),
        y: a.y.slice(..),
        dy: a.dy.slice(..),
        gamma: a.gamma.slice(..),
        beta: a.beta.slice(..),
        saved: a.saved,
        dz: p.dz.as_view_mut(),
        dx: p.dx.as_mut().map(|d| d.as_view_mut()),
        accumulate_dx: a.accumulate_dx,
        dw: p.dw.as_view_mut(),
        dgamma: p.dgamma.as_view_mut(),
        dbeta: p.dbeta.as_view_mut(),
        d_addend: Some(p.d_addend.as_view_mut()),
    }
}
