//! [`ConvBnChain`]'s prologue route on validated operands: the first convolution with its
//! statistics ([`super::ConvStats`]); per inner link the BatchNorm's finalize into an equivalent
//! scale and bias (`chain_kernel`), then the next convolution with `relu(z · scale + bias)` on
//! its input and `GEN_STATS` on its output (one cuDNN graph); the last BatchNorm from its sums
//! on nnfuse's own kernels. Backward: the last BatchNorm's own backward; per inner link, last
//! first, the data gradient with the ReLU's backward and the BatchNorm's backward weights (one
//! graph), the filter gradient with the same input prologue (one graph), and the BatchNorm's
//! data gradient from the graph's coefficients (`chain_kernel`); the first convolution's
//! gradients through its `Conv2d`.

use super::chain::{AddendGrad, ChainArgs, ChainBackwardArgs, ChainSaved, ConvBnChain};
use super::chain_graphs::LinkGraphs;
use super::chain_kernel::{apply_eq, finalize_affine, ApplyEq, FinalizeAffine};
use super::train::Fused;
use crate::batchnorm::{BackwardArgs, TrainArgs};
use crate::dtype::Element;
use cudarc::driver::DevicePtr;

use crate::error::{Error, Result};
use crate::validate::{Aliasing, Binder, Need};

/// Per-unit argument names (errors name the unit's entry).
const W: [&str; 8] = [
    "w[0]", "w[1]", "w[2]", "w[3]", "w[4]", "w[5]", "w[6]", "w[7]",
];
const GAMMA: [&str; 8] = [
    "gamma[0]", "gamma[1]", "gamma[2]", "gamma[3]", "gamma[4]", "gamma[5]", "gamma[6]", "gamma[7]",
];
const BETA: [&str; 8] = [
    "beta[0]", "beta[1]", "beta[2]", "beta[3]", "beta[4]", "beta[5]", "beta[6]", "beta[7]",
];
const RMEAN: [&str; 8] = [
    "running_mean[0]",
    "running_mean[1]",
    "running_mean[2]",
    "running_mean[3]",
    "running_mean[4]",
    "running_mean[5]",
    "running_mean[6]",
    "running_mean[7]",
];
const RVAR: [&str; 8] = [
    "running_var[0]",
    "running_var[1]",
    "running_var[2]",
    "running_var[3]",
    "running_var[4]",
    "running_var[5]",
    "running_var[6]",
    "running_var[7]",
];
const DW: [&str; 8] = [
    "dw[0]", "dw[1]", "dw[2]", "dw[3]", "dw[4]", "dw[5]", "dw[6]", "dw[7]",
];
const DGAMMA: [&str; 8] = [
    "dgamma[0]",
    "dgamma[1]",
    "dgamma[2]",
    "dgamma[3]",
    "dgamma[4]",
    "dgamma[5]",
    "dgamma[6]",
    "dgamma[7]",
];
const DBETA: [&str; 8] = [
    "dbeta[0]", "dbeta[1]", "dbeta[2]", "dbeta[3]", "dbeta[4]", "dbeta[5]", "dbeta[6]", "dbeta[7]",
];

/// Whether every address is 16-byte aligned (the graphs' tensors are built for it).
fn aligned(p: &[u64]) -> bool {
    p.iter().all(|a| a % 16 == 0)
}

fn misaligned(what: &'static str) -> Error {
    Error::invalid(
        what,
        "not 16-byte aligned: the prologue route's cuDNN graphs are built for 16-byte aligned \
         tensors (the units route takes any alignment)",
    )
}

impl<T: Element> ConvBnChain<T> {
    fn fused_unit(&self, i: usize) -> Result<&Fused<T>> {
        self.units[i].fused.as_ref().ok_or_else(|| {
            Error::NotSupported(format!(
                "unit {i} has no fused parts: {}",
                self.units[i].plan().reason(super::TrainRoute::Fused)
            ))
        })
    }

    /// The first of the caller's operands the prologue route's graphs read that is not
    /// 16-byte aligned (a filter after the first, an inner BatchNorm's γ or β), or `None`.
    pub(super) fn forward_misaligned(&self, a: &ChainArgs<'_, T>) -> Option<&'static str> {
        let st = self.ctx.stream();
        let n = self.shapes.len();
        let w = (1..n).find(|&i| a.w.get(i).is_some_and(|v| v.device_ptr(st).0 % 16 != 0));
        if let Some(i) = w {
            return Some(W[i]);
        }
        (0..n - 1).find_map(|i| {
            let b = a.bn.get(i)?;
            if b.gamma.device_ptr(st).0 % 16 != 0 {
                Some(GAMMA[i])
            } else if b.beta.device_ptr(st).0 % 16 != 0 {
                Some(BETA[i])
            } else {
                None
            }
        })
    }

    /// The first of the caller's operands the prologue route's backward graphs read or write
    /// that is not 16-byte aligned, or `None`.
    fn backward_misaligned(&self, a: &ChainBackwardArgs<'_, T>) -> Option<&'static str> {
        let st = self.ctx.stream();
        let bad = |p: u64| p % 16 != 0;
        for i in 1..self.shapes.len() {
            if a.w.get(i).is_some_and(|v| bad(v.device_ptr(st).0)) {
                return Some(W[i]);
            }
            if a.dw.get(i).is_some_and(|v| bad(v.device_ptr(st).0)) {
                return Some(DW[i]);
            }
            let j = i - 1;
            let vecs: [(&'static str, Option<u64>); 4] = [
                (GAMMA[j], a.gamma.get(j).map(|v| v.device_ptr(st).0)),
                (BETA[j], a.beta.get(j).map(|v| v.device_ptr(st).0)),
                (DGAMMA[j], a.dgamma.get(j).map(|v| v.device_ptr(st).0)),
                (DBETA[j], a.dbeta.get(j).map(|v| v.device_ptr(st).0)),
            ];
            if let Some((name, _)) = vecs.iter().find(|(_, p)| p.is_some_and(bad)) {
                return Some(name);
            }
        }
        None
    }

    /// The prologue route's forward (see the module docs).
    pub(super) fn forward_prologue(
        &self,
        a: &mut ChainArgs<'_, T>,
        saved: &mut ChainSaved<T>,
    ) -> Result<()> {
        crate::batchnorm::check_scalars(a.eps, Some(a.momentum))?;
        let graphs = self.link_graphs()?;
        let n = self.shapes.len();
        saved.last = None;
        {
            let f0 = self.fused_unit(0)?;
            let (s0, q0) = &mut saved.sums[0];
            f0.stats.forward(
                &a.x,
                &a.w[0],
                &mut saved.z[0].as_view_mut(),
                &mut s0.as_view_mut(),
                &mut q0.as_view_mut(),
            )?;
        }
        for i in 0..n - 1 {
            self.finalize(i, a, saved)?;
            self.fprop(i, &graphs[i], a, saved, None)?;
        }
        let fl = self.fused_unit(n - 1)?;
        let (s, q) = &saved.sums[n - 1];
        let bn = &mut a.bn[n - 1];
        saved.last = Some(fl.bn.forward_train_from_sums(
            TrainArgs {
                x: saved.z[n - 1].as_view(),
                addend: a.addend.as_ref().map(|v| v.slice(..)),
                gamma: bn.gamma.slice(..),
                beta: bn.beta.slice(..),
                running_mean: bn.running_mean.slice_mut(..),
                running_var: bn.running_var.slice_mut(..),
                y: a.y.slice_mut(..),
                momentum: a.momentum,
                eps: a.eps,
            },
            &s.as_view(),
            &q.as_view(),
        )?);
        Ok(())
    }

    /// Unit `i`'s BatchNorm statistics from its sums: saved mean and inverse std, running
    /// statistics, and the equivalent scale and bias the next convolution's prologue applies.
    fn finalize(
        &self,
        i: usize,
        a: &mut ChainArgs<'_, T>,
        saved: &mut ChainSaved<T>,
    ) -> Result<()> {
        let sh = &self.shapes[i];
        let c = sh.c_out;
        let (oh, ow) = sh.out_hw()?;
        let count = sh.n * oh * ow;
        let need = Need::Exactly(c, "the unit's output channels");
        let bn = &mut a.bn[i];
        let mut ops = Binder::new(&self.ctx);
        let (sum, sqsum) = &saved.sums[i];
        let sum = ops.input("sum", sum, need)?;
        let sqsum = ops.input("sqsum", sqsum, need)?;
        let gamma = ops.input(GAMMA[i], &bn.gamma, need)?;
        let beta = ops.input(BETA[i], &bn.beta, need)?;
        let running_mean = ops.output(RMEAN[i], &mut bn.running_mean, need)?;
        let running_var = ops.output(RVAR[i], &mut bn.running_var, need)?;
        let (mh, ml) = &mut saved.mean[i];
        let saved_mean = ops.output("saved_mean", mh, need)?;
        let saved_mean_lo = ops.output("saved_mean_lo", ml, need)?;
        let saved_invstd = ops.output("saved_inv_std", &mut saved.inv_std[i], need)?;
        let (es, eb) = &mut saved.eq[i];
        let eq_scale = ops.output("eq_scale", es, need)?;
        let eq_bias = ops.output("eq_bias", eb, need)?;
        ops.check(Aliasing::Distinct)?;
        let args = FinalizeAffine {
            sum,
            sqsum,
            gamma,
            beta,
            saved_mean,
            saved_mean_lo,
            saved_invstd,
            running_mean,
            running_var,
            eq_scale,
            eq_bias,
            count: count as f64,
            channels: u32::try_from(c)
                .map_err(|_| Error::invalid("shapes", format!("{c} channels exceed u32")))?,
            eps: a.eps as f32,
            momentum: a.momentum,
        };
        // SAFETY: every address validated above (device, lengths, outputs distinct); count > 1
        // is checked by the launcher.
        unsafe { finalize_affine(&self.ctx, T::DTYPE, &args) }
    }

    /// Unit `i + 1`'s convolution of `relu(z_i · scale + bias)`, with its output's sums.
    pub(super) fn fprop(
        &self,
        i: usize,
        g: &LinkGraphs,
        a: &ChainArgs<'_, T>,
        saved: &mut ChainSaved<T>,
        plan: Option<usize>,
    ) -> Result<()> {
        let sh = &self.shapes[i + 1];
        let (zin, zout) = saved.z.split_at_mut(i + 1);
        let mut ops = Binder::new(&self.ctx);
        let c_in = Need::Exactly(sh.c_in, "the unit's input channels");
        let c_out = Need::Exactly(sh.c_out, "the unit's output channels");
        let x = ops.input("z", &zin[i], Need::Exactly(sh.x_len()?, "the unit's input"))?;
        let (es, eb) = &saved.eq[i];
        let scale = ops.input("eq_scale", es, c_in)?;
        let bias = ops.input("eq_bias", eb, c_in)?;
        let w = ops.input(
            W[i + 1],
            &a.w[i + 1],
            Need::Exactly(sh.w_len()?, "the filter"),
        )?;
        let y = ops.output(
            "z",
            &mut zout[0],
            Need::Exactly(sh.y_len()?, "the unit's output"),
        )?;
        let (s, q) = &mut saved.sums[i + 1];
        let sum = ops.output("sum", s, c_out)?;
        let sqsum = ops.output("sqsum", q, c_out)?;
        ops.check(Aliasing::Distinct)?;
        let p = [x, scale, bias, w, y, sum, sqsum];
        if !aligned(&p) {
            return Err(misaligned(W[i + 1]));
        }
        // SAFETY: validated above in the pattern's tensor order; aligned.
        unsafe { g.fprop.execute(&self.ctx, plan, &p) }
    }

    /// The prologue route's backward (see the module docs).
    pub(super) fn backward_prologue(
        &self,
        mut a: ChainBackwardArgs<'_, T>,
        saved: &mut ChainSaved<T>,
    ) -> Result<()> {
        // Refused before anything runs (the forward took this route, so it cannot change).
        if let Some(what) = self.backward_misaligned(&a) {
            return Err(misaligned(what));
        }
        let graphs = self.link_graphs()?;
        let n = self.shapes.len();
        let last_saved = saved
            .last
            .as_ref()
            .ok_or_else(|| Error::invalid("saved", "the forward did not finish"))?;
        let mut dx = a.dx.take();
        let into_dx = matches!(a.d_addend, AddendGrad::IntoDx);
        let d_addend = match &mut a.d_addend {
            AddendGrad::None => None,
            AddendGrad::Into(v) => Some(v.slice_mut(..)),
            AddendGrad::IntoDx => dx.as_mut().map(|d| d.slice_mut(..)),
        };
        self.fused_unit(n - 1)?.bn.backward(BackwardArgs {
            x: saved.z[n - 1].as_view(),
            y: a.y.slice(..),
            dy: a.dy.slice(..),
            gamma: a.gamma[n - 1].slice(..),
            beta: a.beta[n - 1].slice(..),
            saved: last_saved,
            dx: saved.dz[n - 1].as_view_mut(),
            d_addend,
            dgamma: a.dgamma[n - 1].slice_mut(..),
            dbeta: a.dbeta[n - 1].slice_mut(..),
        })?;
        for i in (0..n - 1).rev() {
            self.dgrad(i, &graphs[i], &mut a, saved, None)?;
            self.wgrad(i, &graphs[i], &mut a, saved, None)?;
            self.apply_dbn(i, saved)?;
        }
        let conv = self.units[0].conv();
        if let Some(mut dx) = dx {
            conv.backward_data_into(
                &saved.dz[0].as_view(),
                &a.w[0],
                &mut dx,
                a.accumulate_dx || into_dx,
            )?;
        }
        conv.backward_filter(&a.x, &saved.dz[0].as_view(), &mut a.dw[0], false)
    }

    /// Link `i`: the data gradient of unit i + 1 through unit i's ReLU (recomputed from z_i
    /// and its statistics) into `drelu`, and unit i's BatchNorm backward weights: dgamma,
    /// dbeta and the coefficients of its data gradient.
    pub(super) fn dgrad(
        &self,
        i: usize,
        g: &LinkGraphs,
        a: &mut ChainBackwardArgs<'_, T>,
        saved: &mut ChainSaved<T>,
        plan: Option<usize>,
    ) -> Result<()> {
        let sh = &self.shapes[i + 1];
        let c = sh.c_in;
        let need = Need::Exactly(c, "the unit's output channels");
        let x_len = sh.x_len()?;
        let mut drelu_v = saved.drelu.slice_mut(..x_len);
        let (mut ca, mut rest) = saved.coef.split_at_mut(c);
        let (mut cb, mut rest) = rest.split_at_mut(c);
        let mut cc = rest.slice_mut(..c);
        let mut ops = Binder::new(&self.ctx);
        let dy = ops.input(
            "dz",
            &saved.dz[i + 1],
            Need::Exactly(sh.y_len()?, "the output"),
        )?;
        let w = ops.input(
            W[i + 1],
            &a.w[i + 1],
            Need::Exactly(sh.w_len()?, "the filter"),
        )?;
        let x = ops.input("z", &saved.z[i], Need::Exactly(x_len, "the unit's output"))?;
        let mean = ops.input("saved_mean", &saved.mean[i].0, need)?;
        let inv_std = ops.input("saved_inv_std", &saved.inv_std[i], need)?;
        let scale = ops.input(GAMMA[i], &a.gamma[i], need)?;
        let bias = ops.input(BETA[i], &a.beta[i], need)?;
        let drelu = ops.output("drelu", &mut drelu_v, Need::Exactly(x_len, "z"))?;
        let dscale = ops.output(DGAMMA[i], &mut a.dgamma[i], need)?;
        let dbias = ops.output(DBETA[i], &mut a.dbeta[i], need)?;
        let eq_a = ops.output("eq_scale_dy", &mut ca, need)?;
        let eq_b = ops.output("eq_scale_x", &mut cb, need)?;
        let eq_c = ops.output("eq_bias", &mut cc, need)?;
        ops.check(Aliasing::Distinct)?;
        let p = [
            dy, w, x, mean, inv_std, scale, bias, drelu, dscale, dbias, eq_a, eq_b, eq_c,
        ];
        if !aligned(&p) {
            return Err(misaligned(GAMMA[i]));
        }
        // SAFETY: validated above in the pattern's tensor order; aligned.
        unsafe { g.dgrad.execute(&self.ctx, plan, &p) }
    }

    /// Link `i`: unit i + 1's filter gradient from `relu(z_i · scale + bias)` and dz_{i+1}.
    pub(super) fn wgrad(
        &self,
        i: usize,
        g: &LinkGraphs,
        a: &mut ChainBackwardArgs<'_, T>,
        saved: &ChainSaved<T>,
        plan: Option<usize>,
    ) -> Result<()> {
        let sh = &self.shapes[i + 1];
        let c_in = Need::Exactly(sh.c_in, "the unit's input channels");
        let mut ops = Binder::new(&self.ctx);
        let x = ops.input(
            "z",
            &saved.z[i],
            Need::Exactly(sh.x_len()?, "the unit's input"),
        )?;
        let (es, eb) = &saved.eq[i];
        let scale = ops.input("eq_scale", es, c_in)?;
        let bias = ops.input("eq_bias", eb, c_in)?;
        let dy = ops.input(
            "dz",
            &saved.dz[i + 1],
            Need::Exactly(sh.y_len()?, "the output"),
        )?;
        let dw = ops.output(
            DW[i + 1],
            &mut a.dw[i + 1],
            Need::Exactly(sh.w_len()?, "the filter"),
        )?;
        ops.check(Aliasing::Distinct)?;
        let p = [x, scale, bias, dy, dw];
        if !aligned(&p) {
            return Err(misaligned(DW[i + 1]));
        }
        // SAFETY: validated above in the pattern's tensor order; aligned.
        unsafe { g.wgrad.execute(&self.ctx, plan, &p) }
    }

    /// Link `i`: dz_i = eq_scale_dy · drelu + eq_scale_x · z_i + eq_bias, per channel.
    fn apply_dbn(&self, i: usize, saved: &mut ChainSaved<T>) -> Result<()> {
        let sh = &self.shapes[i];
        let c = sh.c_out;
        let len = sh.y_len()?;
        let need = Need::Exactly(c, "the unit's output channels");
        let ChainSaved {
            z, dz, drelu, coef, ..
        } = saved;
        let (drelu_v, coef_a, coef_b, coef_c) = (
            drelu.slice(..len),
            coef.slice(..c),
            coef.slice(c..2 * c),
            coef.slice(2 * c..3 * c),
        );
        let mut ops = Binder::new(&self.ctx);
        let dy = ops.input("drelu", &drelu_v, Need::Exactly(len, "z"))?;
        let x = ops.input("z", &z[i], Need::Exactly(len, "z"))?;
        let ca = ops.input("eq_scale_dy", &coef_a, need)?;
        let cb = ops.input("eq_scale_x", &coef_b, need)?;
        let cc = ops.input("eq_bias", &coef_c, need)?;
        let out = ops.output("dz", &mut dz[i], Need::Exactly(len, "z"))?;
        ops.check(Aliasing::Distinct)?;
        let args = ApplyEq {
            dy,
            x,
            a: ca,
            b: cb,
            c: cc,
            dz: out,
            len: len as u64,
            channels: u32::try_from(c)
                .map_err(|_| Error::invalid("shapes", format!("{c} channels exceed u32")))?,
        };
        // SAFETY: validated above (device, lengths, the output distinct).
        unsafe { apply_eq(&self.ctx, T::DTYPE, &args) }
    }
}
