//! The GPU half of `nnfuse demo`: the block's buffers, its layers under one variant, one
//! training step through nnfuse's dispatchers (or the plain cuDNN compositions), the check run,
//! and the timed steps with CUDA events.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context as _, Result};
use cudarc::driver::{sys as drv, CudaEvent, CudaSlice, DeviceRepr};
use nnfuse::activation;
use nnfuse::batchnorm::{BackwardArgs, BatchNorm, BnSaved, Fuse, TrainArgs};
use nnfuse::block::{
    ConvBnArgs, ConvBnBackwardArgs, ConvBnTrain, ConvDone, StatsRoute, TrainChoice, TrainRoute,
    TrainSaved,
};
use nnfuse::conv::{AutoReport, Conv2d, ConvChoice, Direction, Route};
use nnfuse::gemm::{self, Algo};
use nnfuse::internals::util;
use nnfuse::{Context, Element};

use super::bits::OUTPUTS;
use super::block::{direction_index, BlockDef, Op, EPS, MOMENTUM, STEP};
use super::check::{
    check_classifier, check_step, random_inputs, tolerance, StepInputs, StepOutputs,
};
use super::host::{busy_step_ms, profile_steps, BusyGpu};
use super::host_profile::HostProfile;
use super::report::{CheckReport, Decision, GraphReport, StepTimes, VariantRun};
use super::units::{self, Unit};
use super::variants::Variant;

/// `[f(0)?, f(1)?, f(2)?]`.
fn three<X>(mut f: impl FnMut(usize) -> Result<X>) -> Result<[X; 3]> {
    Ok([f(0)?, f(1)?, f(2)?])
}

fn zeros<T: Element>(ctx: &Context, n: usize) -> Result<CudaSlice<T>> {
    Ok(ctx.stream().alloc_zeros::<T>(n)?)
}

/// Every tensor of one step at one batch (shared by the variants: each step overwrites what it
/// writes before it reads it).
pub struct Buffers<T: Element> {
    /// The sizes.
    pub def: BlockDef,
    x: CudaSlice<T>,
    w: [CudaSlice<T>; 3],
    gamma: [CudaSlice<f32>; 3],
    beta: [CudaSlice<f32>; 3],
    rm: [CudaSlice<f32>; 3],
    rv: [CudaSlice<f32>; 3],
    a: [CudaSlice<T>; 3],
    h: [CudaSlice<T>; 3],
    dout: CudaSlice<T>,
    dh: [CudaSlice<T>; 2],
    da: [CudaSlice<T>; 3],
    dx_conv: CudaSlice<T>,
    dx: CudaSlice<T>,
    dw: [CudaSlice<T>; 3],
    dgamma: [CudaSlice<f32>; 3],
    dbeta: [CudaSlice<f32>; 3],
    /// The plain compositions' ReLU gradient before BatchNorm 1 and 2's backward.
    relu_grad: CudaSlice<T>,
    /// The fused units' per-channel sums of `a[i]` (ConvStats to BatchNorm from sums).
    sum: [CudaSlice<f32>; 3],
    /// The fused units' per-channel sums of squares of `a[i]`.
    sqsum: [CudaSlice<f32>; 3],
    feat: CudaSlice<T>,
    fc_w: CudaSlice<T>,
    logits: CudaSlice<T>,
    dlogits: CudaSlice<T>,
    fc_dw: CudaSlice<T>,
    dfeat: CudaSlice<T>,
}

impl<T: Element> Buffers<T> {
    /// Allocates every tensor of `def` (zeros; fill or upload the inputs next).
    pub fn new(ctx: &Context, def: &BlockDef) -> Result<Self> {
        let act = |ch: usize| def.act_len(ch);
        let bn_ch = |i: usize| def.bn_channels(i);
        Ok(Buffers {
            def: *def,
            x: zeros(ctx, act(def.c))?,
            w: three(|i| zeros(ctx, def.conv(i).w_len()?))?,
            gamma: three(|i| zeros(ctx, bn_ch(i)))?,
            beta: three(|i| zeros(ctx, bn_ch(i)))?,
            rm: three(|i| zeros(ctx, bn_ch(i)))?,
            rv: three(|i| zeros(ctx, bn_ch(i)))?,
            a: three(|i| zeros(ctx, act(bn_ch(i))))?,
            h: three(|i| zeros(ctx, act(bn_ch(i))))?,
            dout: zeros(ctx, act(def.c))?,
            dh: [zeros(ctx, act(def.mid))?, zeros(ctx, act(def.mid))?],
            da: three(|i| zeros(ctx, act(bn_ch(i))))?,
            dx_conv: zeros(ctx, act(def.c))?,
            dx: zeros(ctx, act(def.c))?,
            dw: three(|i| zeros(ctx, def.conv(i).w_len()?))?,
            dgamma: three(|i| zeros(ctx, bn_ch(i)))?,
            dbeta: three(|i| zeros(ctx, bn_ch(i)))?,
            relu_grad: zeros(ctx, act(def.mid))?,
            sum: three(|i| zeros(ctx, bn_ch(i)))?,
            sqsum: three(|i| zeros(ctx, bn_ch(i)))?,
            feat: zeros(ctx, def.n * def.fc_in)?,
            fc_w: zeros(ctx, def.fc_out * def.fc_in)?,
            logits: zeros(ctx, def.n * def.fc_out)?,
            dlogits: zeros(ctx, def.n * def.fc_out)?,
            fc_dw: zeros(ctx, def.fc_out * def.fc_in)?,
            dfeat: zeros(ctx, def.n * def.fc_in)?,
        })
    }

    /// Fills the inputs on the GPU with pseudo-random values in [-1, 1) (a function of `seed`;
    /// `nnfuse::internals::gemm::fill_uniform`), BatchNorm's scales and biases from the host, running statistics
    /// 0 and 1. For the timed steps, whose inputs are too large to draw on the host quickly.
    pub fn fill_random(&mut self, ctx: &Context, seed: u64) -> Result<()> {
        let mut s = seed;
        let mut next = || {
            s = s.wrapping_add(1);
            s
        };
        nnfuse::internals::gemm::fill_uniform(ctx, &mut self.x, next())?;
        for w in &mut self.w {
            nnfuse::internals::gemm::fill_uniform(ctx, w, next())?;
        }
        nnfuse::internals::gemm::fill_uniform(ctx, &mut self.dout, next())?;
        nnfuse::internals::gemm::fill_uniform(ctx, &mut self.feat, next())?;
        nnfuse::internals::gemm::fill_uniform(ctx, &mut self.fc_w, next())?;
        nnfuse::internals::gemm::fill_uniform(ctx, &mut self.dlogits, next())?;
        let stream = ctx.stream();
        for i in 0..3 {
            let c = self.def.bn_channels(i);
            stream.memcpy_htod(&host_uniform(next(), c, 0.5, 1.5), &mut self.gamma[i])?;
            stream.memcpy_htod(&host_uniform(next(), c, -0.5, 0.5), &mut self.beta[i])?;
            util::fill(ctx, &mut self.rm[i], 0.0f32)?;
            util::fill(ctx, &mut self.rv[i], 1.0f32)?;
        }
        Ok(())
    }

    /// Uploads `inp` (values already rounded to what the buffers hold), running statistics
    /// included, and poisons every output with NaN so that an element a step does not write
    /// shows in the check.
    pub fn upload_and_poison(&mut self, ctx: &Context, inp: &StepInputs) -> Result<()> {
        let s = ctx.stream();
        s.memcpy_htod(&to_t::<T>(&inp.x), &mut self.x)?;
        s.memcpy_htod(&to_t::<T>(&inp.dout), &mut self.dout)?;
        s.memcpy_htod(&to_t::<T>(&inp.feat), &mut self.feat)?;
        s.memcpy_htod(&to_t::<T>(&inp.fc_w), &mut self.fc_w)?;
        s.memcpy_htod(&to_t::<T>(&inp.dlogits), &mut self.dlogits)?;
        for i in 0..3 {
            s.memcpy_htod(&to_t::<T>(&inp.w[i]), &mut self.w[i])?;
            s.memcpy_htod(&to_f32(&inp.gamma[i]), &mut self.gamma[i])?;
            s.memcpy_htod(&to_f32(&inp.beta[i]), &mut self.beta[i])?;
            s.memcpy_htod(&to_f32(&inp.running_mean[i]), &mut self.rm[i])?;
            s.memcpy_htod(&to_f32(&inp.running_var[i]), &mut self.rv[i])?;
        }
        self.poison(ctx)
    }

    /// NaN into every output of a step.
    pub fn poison(&mut self, ctx: &Context) -> Result<()> {
        let nan = T::from_f64(f64::NAN);
        for b in self
            .a
            .iter_mut()
            .chain(&mut self.h)
            .chain(&mut self.dh)
            .chain(&mut self.da)
            .chain(&mut self.dw)
            .chain([
                &mut self.dx_conv,
                &mut self.dx,
                &mut self.relu_grad,
                &mut self.logits,
                &mut self.fc_dw,
                &mut self.dfeat,
            ])
        {
            util::fill(ctx, b, nan)?;
        }
        // The fused units' sums too: a unit that read sums nobody wrote shows in its outputs.
        for b in self
            .dgamma
            .iter_mut()
            .chain(&mut self.dbeta)
            .chain(&mut self.sum)
            .chain(&mut self.sqsum)
        {
            util::fill(ctx, b, f32::NAN)?;
        }
        Ok(())
    }

    /// The running means and variances of the three BatchNorms (`[mean 1..3, var 1..3]`;
    /// waits for the stream): a step updates them in place, so steps compared with each other
    /// start from the same ones.
    pub fn running_stats(&self, ctx: &Context) -> Result<Vec<Vec<f32>>> {
        let s = ctx.stream();
        self.rm
            .iter()
            .chain(&self.rv)
            .map(|b| Ok(s.clone_dtoh(b)?))
            .collect()
    }

    /// Writes back what [`Buffers::running_stats`] read (into the same buffers: a captured
    /// graph keeps their addresses).
    pub fn set_running_stats(&mut self, ctx: &Context, stats: &[Vec<f32>]) -> Result<()> {
        if stats.len() != 6 {
            bail!("{} running statistics given, 6 expected", stats.len());
        }
        let s = ctx.stream();
        for (b, v) in self.rm.iter_mut().chain(&mut self.rv).zip(stats) {
            s.memcpy_htod(v, b)?;
        }
        Ok(())
    }

    /// The raw bytes of every output of a step, in [`super::bits::OUTPUTS`]' order (waits for
    /// the stream).
    pub fn raw_outputs(&self, ctx: &Context) -> Result<Vec<Vec<u8>>> {
        let mut out = Vec::with_capacity(OUTPUTS.len());
        for b in self.a.iter().chain(&self.h) {
            out.push(raw(ctx, b)?);
        }
        for b in self.rm.iter().chain(&self.rv) {
            out.push(raw(ctx, b)?);
        }
        for b in &self.da {
            out.push(raw(ctx, b)?);
        }
        for b in self.dgamma.iter().chain(&self.dbeta) {
            out.push(raw(ctx, b)?);
        }
        for b in self
            .dh
            .iter()
            .chain([&self.dx_conv, &self.dx])
            .chain(&self.dw)
            .chain([&self.logits, &self.fc_dw, &self.dfeat])
        {
            out.push(raw(ctx, b)?);
        }
        Ok(out)
    }

    /// NaN into the classifier's outputs only.
    pub fn poison_classifier(&mut self, ctx: &Context) -> Result<()> {
        let nan = T::from_f64(f64::NAN);
        for b in [&mut self.logits, &mut self.fc_dw, &mut self.dfeat] {
            util::fill(ctx, b, nan)?;
        }
        Ok(())
    }

    /// Everything a step wrote, widened to f64 (waits for the stream).
    pub fn download_outputs(&self, ctx: &Context) -> Result<StepOutputs> {
        let t = |b: &CudaSlice<T>| widened(ctx, b);
        let f = |b: &CudaSlice<f32>| -> Result<Vec<f64>> {
            Ok(ctx
                .stream()
                .clone_dtoh(b)?
                .iter()
                .map(|&v| v as f64)
                .collect())
        };
        Ok(StepOutputs {
            a: three(|i| t(&self.a[i]))?,
            h: three(|i| t(&self.h[i]))?,
            running_mean: three(|i| f(&self.rm[i]))?,
            running_var: three(|i| f(&self.rv[i]))?,
            da: three(|i| t(&self.da[i]))?,
            dh: [t(&self.dh[0])?, t(&self.dh[1])?],
            dx_conv: t(&self.dx_conv)?,
            dx: t(&self.dx)?,
            dw: three(|i| t(&self.dw[i]))?,
            dgamma: three(|i| f(&self.dgamma[i]))?,
            dbeta: three(|i| f(&self.dbeta[i]))?,
            logits: t(&self.logits)?,
            fc_dw: t(&self.fc_dw)?,
            dfeat: t(&self.dfeat)?,
        })
    }

    /// The classifier's outputs, widened (the other fields are left empty; waits for the
    /// stream).
    pub fn download_classifier_outputs(&self, ctx: &Context) -> Result<StepOutputs> {
        let t = |b: &CudaSlice<T>| widened(ctx, b);
        Ok(StepOutputs {
            logits: t(&self.logits)?,
            fc_dw: t(&self.fc_dw)?,
            dfeat: t(&self.dfeat)?,
            ..Default::default()
        })
    }

    /// The classifier's inputs, widened (the other fields are left empty).
    pub fn download_classifier_inputs(&self, ctx: &Context) -> Result<StepInputs> {
        let t = |b: &CudaSlice<T>| widened(ctx, b);
        Ok(StepInputs {
            feat: t(&self.feat)?,
            fc_w: t(&self.fc_w)?,
            dlogits: t(&self.dlogits)?,
            ..Default::default()
        })
    }
}

/// `b`'s values widened to f64 (waits for the stream).
fn widened<T: Element>(ctx: &Context, b: &CudaSlice<T>) -> Result<Vec<f64>> {
    Ok(ctx
        .stream()
        .clone_dtoh(b)?
        .iter()
        .map(|v| v.to_f64())
        .collect())
}

/// The bytes of `b` as the GPU holds them (waits for the stream).
fn raw<X: DeviceRepr>(ctx: &Context, b: &CudaSlice<X>) -> Result<Vec<u8>> {
    // SAFETY: every byte pattern is a valid u8, and the view covers exactly `b`'s bytes.
    let bytes = unsafe { b.transmute::<u8>(b.num_bytes()) }.ok_or_else(|| {
        anyhow!(
            "a buffer of {} bytes cannot be read as bytes",
            b.num_bytes()
        )
    })?;
    Ok(ctx.stream().clone_dtoh(&bytes)?)
}

/// `n` values uniform in `[lo, hi)` (SplitMix64 of `seed`).
fn host_uniform(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            lo + (hi - lo) * ((z >> 40) as f32 / (1u32 << 24) as f32)
        })
        .collect()
}

fn to_t<T: Element>(v: &[f64]) -> Vec<T> {
    v.iter().map(|&x| T::from_f64(x)).collect()
}

fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// The block's layers under one variant on one Context (which decides with the variant's
/// configuration).
pub struct Layers<T: Element> {
    /// The variant.
    pub variant: Variant,
    /// Its Context.
    pub ctx: Context,
    /// The sizes.
    pub def: BlockDef,
    /// The three convolutions.
    pub convs: [Conv2d<T>; 3],
    /// The three BatchNorms (fused with their activation for nnfuse, plain for the others).
    pub bns: [BatchNorm<T>; 3],
    /// Routes forced on the convolutions (`[conv][direction]`): the check runs the routes the
    /// timed batch decided; `None`: the dispatcher decides.
    forced: [[Option<Route>; 3]; 3],
    /// nnfuse's training units (conv then BatchNorm, fused or not as each decides on its first
    /// forward), or why none.
    units: [Unit<T>; 3],
    /// Unit routes given to these layers, with the ConvStats route of a fused one (the check
    /// runs the timed batch's); `None`: the unit decides.
    given: [Option<(TrainRoute, Option<StatsRoute>)>; 3],
    /// Unit backwards given to these layers (folded or composed; the check's).
    given_fold: [Option<bool>; 3],
}

impl<T: Element> Layers<T> {
    /// Plans the layers of `def` for `variant` on `ctx` (a Context with the variant's
    /// configuration).
    pub fn new(ctx: &Context, def: &BlockDef, variant: Variant) -> Result<Self> {
        let convs = three(|i| Ok(Conv2d::<T>::new(ctx, &def.conv(i))?))?;
        let bns = three(|i| {
            let (shape, axis) = def.bn_shape(i);
            Ok(BatchNorm::<T>::new(ctx, &shape, axis, variant.fuse(i))?)
        })?;
        Ok(Layers {
            variant,
            ctx: ctx.clone(),
            def: *def,
            convs,
            bns,
            forced: [[None; 3]; 3],
            units: units::build(ctx, def, variant),
            given: [None; 3],
            given_fold: [None; 3],
        })
    }

    /// Unit `i`'s route: given (the check's), else decided; `None` before its first forward.
    pub fn unit_route(&self, i: usize) -> Option<TrainRoute> {
        self.given[i].map(|g| g.0).or_else(|| {
            let u = self.units[i].as_ref().ok()?;
            u.choice().map(|c| c.route)
        })
    }

    /// Unit `i` when it runs fused (built, and decided or given fused).
    pub fn fused_unit(&self, i: usize) -> Option<&ConvBnTrain<T>> {
        match &self.units[i] {
            Ok(u) if self.unit_route(i) == Some(TrainRoute::Fused) => Some(u),
            _ => None,
        }
    }

    /// Unit `i` when its whole backward (BatchNorm and both convolution gradients, composed or
    /// folded as it decides) runs at `bnN.bwd`: fused, and the fold eligible.
    pub fn unit_backward(&self, i: usize) -> Option<&ConvBnTrain<T>> {
        self.fused_unit(i).filter(|u| u.fold_refusal().is_none())
    }

    /// Whether unit `i`'s backward folds (given, else decided).
    pub fn unit_folds(&self, i: usize) -> bool {
        self.unit_backward(i).is_some_and(|u| {
            self.given_fold[i]
                .or_else(|| u.backward_folds())
                .unwrap_or(false)
        })
    }

    /// Unit `i` while its next forward measures (built, nothing given, and no decision yet or
    /// a provisional one whose kernels are ready now).
    fn undecided_unit(&self, i: usize) -> Option<&ConvBnTrain<T>> {
        match &self.units[i] {
            Ok(u) if self.given[i].is_none() && u.pending() => Some(u),
            _ => None,
        }
    }

    /// Waits for the units' fused kernels, so that a unit decided provisionally on the first
    /// step (its kernels still compiling) decides for good on the next.
    pub fn load_unit_kernels(&self) -> nnfuse::Result<()> {
        for u in self.units.iter().flatten() {
            u.load_fused_kernels()?;
        }
        Ok(())
    }

    /// Unit `i`: built, or why not.
    pub fn unit(&self, i: usize) -> &Unit<T> {
        &self.units[i]
    }

    /// How unit `i` decided, once it did.
    pub fn unit_choice(&self, i: usize) -> Option<TrainChoice> {
        self.units[i].as_ref().ok()?.choice()
    }

    /// The timed batch's unit routes given to these layers (the check's), with the ConvStats
    /// routes they run now forced.
    pub fn give_units(&mut self, from: &Layers<T>) {
        for i in 0..3 {
            if let Some(r) = from.unit_route(i) {
                let stats = from.units[i].as_ref().ok().and_then(|u| u.stats_choice());
                self.given[i] = Some((r, stats.map(|c| c.route)));
            }
            self.given_fold[i] = from.units[i].as_ref().ok().and_then(|u| u.backward_folds());
        }
    }

    /// Lets ConvStats decide its route again (the check's retry at its own batch).
    pub fn unforce_stats(&mut self) {
        for g in self.given.iter_mut().flatten() {
            g.1 = None;
        }
    }

    /// Whether the step's call of convolution `i`'s `d` accumulates (nnfuse's conv1.dgrad,
    /// added into dx in place): its decision is the accumulating one.
    pub fn accumulates(&self, i: usize, d: Direction) -> bool {
        i == 0 && d == Direction::BackwardData && self.variant.adds_dx_in_place()
    }

    /// The decision convolution `i`'s `d` runs in the step (the mode of its call), when made.
    pub fn decision(&self, i: usize, d: Direction) -> Option<ConvChoice> {
        self.convs[i].choice_for(d, self.accumulates(i, d))
    }

    /// The measurement behind [`Layers::decision`], when one was made.
    pub fn measurement(&self, i: usize, d: Direction) -> Option<Arc<AutoReport>> {
        self.convs[i].report_for(d, self.accumulates(i, d))
    }

    /// The routes the convolutions decided (after a first step), `[conv][direction]`.
    pub fn decided_routes(&self) -> [[Option<Route>; 3]; 3] {
        let mut r = [[None; 3]; 3];
        for (i, row) in r.iter_mut().enumerate() {
            for d in Direction::ALL {
                row[direction_index(d)] = self.decision(i, d).map(|c| c.route);
            }
        }
        r
    }

    /// Forces `routes` on the convolutions from now on.
    pub fn force(&mut self, routes: [[Option<Route>; 3]; 3]) {
        self.forced = routes;
    }

    /// The route convolution `i` runs for `d`: the forced one, else the decided one. A fused
    /// unit's forward runs inside ConvStats: on its fused routes no Conv2d route (None), on its
    /// unfused route the decision ConvStats' own Conv2d made (the process-wide decision of this
    /// problem and configuration, which a forced route does not reach).
    pub fn route(&self, i: usize, d: Direction) -> Option<Route> {
        if d == Direction::Forward {
            if let Some(u) = self.fused_unit(i) {
                let route = self.given[i]
                    .and_then(|g| g.1)
                    .or_else(|| u.stats_choice().map(|c| c.route))
                    .unwrap_or(StatsRoute::Unfused);
                if route != StatsRoute::Unfused {
                    return None;
                }
                let key = nnfuse::conv::internals::ChoiceKey::of(
                    self.ctx.info().ordinal as u32,
                    self.convs[i].plan_for(d),
                    self.convs[i].cudnn_search(),
                    false,
                );
                if let Some(c) = nnfuse::conv::internals::lookup_choice(&key) {
                    return Some(c.route);
                }
            }
        }
        self.forced[i][direction_index(d)].or_else(|| self.decision(i, d).map(|c| c.route))
    }

    fn conv_route(&self, op: Op) -> Option<Route> {
        op.conv()
            .and_then(|(i, d)| self.forced[i][direction_index(d)])
    }
}

/// BatchNorm's forward state, carried to its backward: the layer's BatchNorm's, or a unit's.
enum Saved {
    Plain(BnSaved),
    Unit(TrainSaved),
}

/// What one step carries between its operations.
#[derive(Default)]
pub struct StepState {
    /// BatchNorm `i`'s forward state for its backward.
    saved: [Option<Saved>; 3],
    /// A fused unit's receipt from `convN.fwd` for `bnN.fwd`.
    done: [Option<ConvDone>; 3],
    /// `bnN.fwd` already ran inside `convN.fwd` (a unit's deciding first forward).
    bn_ran: [bool; 3],
    /// `convN.dgrad` and `convN.wgrad` already ran inside `bnN.bwd` (the unit's backward).
    grads_ran: [bool; 3],
}

/// Convolution `i`'s forward into `a[i]`: through `unit` (the fused route's first stage,
/// which also writes the unit's sums; the receipt goes to `bnN.fwd`) or through the Conv2d.
fn conv_fwd<T: Element>(
    l: &Layers<T>,
    b: &mut Buffers<T>,
    i: usize,
    unit: Option<&ConvBnTrain<T>>,
) -> nnfuse::Result<Option<ConvDone>> {
    let x = if i == 0 { &b.x } else { &b.h[i - 1] };
    if let Some(u) = unit {
        let stats = l.given[i].and_then(|g| g.1);
        let (xv, wv) = (x.as_view(), b.w[i].as_view());
        let done = u.forward_conv_with(
            TrainRoute::Fused,
            stats,
            &xv,
            &wv,
            &mut b.a[i].as_view_mut(),
        )?;
        return Ok(Some(done));
    }
    match l.conv_route(Op::ConvFwd(i)) {
        Some(r) => l.convs[i].forward_with(r, x, &b.w[i], &mut b.a[i])?,
        None => l.convs[i].forward(x, &b.w[i], &mut b.a[i])?,
    }
    Ok(None)
}

/// The BatchNorm arguments of layer `i`'s training forward.
fn train_args<T: Element>(b: &mut Buffers<T>, i: usize, add: bool) -> TrainArgs<'_, T> {
    TrainArgs {
        x: b.a[i].as_view(),
        addend: add.then(|| b.x.as_view()),
        gamma: b.gamma[i].as_view(),
        beta: b.beta[i].as_view(),
        running_mean: b.rm[i].as_view_mut(),
        running_var: b.rv[i].as_view_mut(),
        y: b.h[i].as_view_mut(),
        momentum: MOMENTUM,
        eps: EPS,
    }
}

/// BatchNorm `i`'s training forward (with the plain compositions' activation kernels): the
/// unit's second stage after its receipt `done`, or the layer's BatchNorm.
fn bn_fwd<T: Element>(
    l: &Layers<T>,
    b: &mut Buffers<T>,
    i: usize,
    done: Option<ConvDone>,
) -> nnfuse::Result<Saved> {
    let ctx = &l.ctx;
    let fused = l.variant.fuse(i);
    let add = fused == Fuse::AddRelu;
    if let (Some(done), Ok(u)) = (done, &l.units[i]) {
        return Ok(Saved::Unit(u.forward_bn(done, train_args(b, i, add))?));
    }
    let s = l.bns[i].forward_train(train_args(b, i, add))?;
    if fused == Fuse::None {
        // The plain composition: the shortcut's add, then the ReLU, each a kernel.
        if BlockDef::bn_fuse(i) == Fuse::AddRelu {
            util::add_assign(ctx, &mut b.h[i], &b.x)?;
        }
        activation::relu_mask_fwd_inplace(ctx, &mut b.h[i], None::<&mut CudaSlice<u32>>)?;
    }
    Ok(Saved::Plain(s))
}

/// Unit `i`'s first forward, on this step's buffers (its input as the step left it): conv `i`
/// and BatchNorm `i` in one `forward_train`, which runs the unfused route into the buffers,
/// checks and times both routes (forward plus the BatchNorm's backward) and keeps its choice.
/// Synchronises: the first step only, never under capture (the check's layers are given the
/// timed batch's routes).
fn decide_unit<T: Element>(
    l: &Layers<T>,
    b: &mut Buffers<T>,
    i: usize,
    unit: &ConvBnTrain<T>,
) -> nnfuse::Result<TrainSaved> {
    let add = l.variant.fuse(i) == Fuse::AddRelu;
    // The unit's input h[i-1] (or x) and its output h[i] are different buffers.
    let (before, rest) = b.h.split_at_mut(i);
    let x = if i == 0 {
        b.x.as_view()
    } else {
        before[i - 1].as_view()
    };
    let args = ConvBnArgs {
        x,
        w: b.w[i].as_view(),
        z: b.a[i].as_view_mut(),
        addend: add.then(|| b.x.as_view()),
        gamma: b.gamma[i].as_view(),
        beta: b.beta[i].as_view(),
        running_mean: b.rm[i].as_view_mut(),
        running_var: b.rv[i].as_view_mut(),
        y: rest[0].as_view_mut(),
        momentum: MOMENTUM,
        eps: EPS,
    };
    unit.forward_train(args)
}

/// Unit `i`'s whole backward at `bnN.bwd`: its BatchNorm's (the shortcut's gradient into dx)
/// and its convolution's two gradients, folded or composed as given or decided (its first
/// backward decides).
fn unit_backward<T: Element>(
    l: &Layers<T>,
    b: &mut Buffers<T>,
    i: usize,
    u: &ConvBnTrain<T>,
    saved: &TrainSaved,
) -> nnfuse::Result<()> {
    let last = i == 2;
    let (before, rest) = b.h.split_at(i);
    let x = if i == 0 { &b.x } else { &before[i - 1] };
    let (dh_lo, dh_hi) = b.dh.split_at_mut(i);
    let dx = if i == 0 {
        &mut b.dx_conv
    } else {
        &mut dh_lo[i - 1]
    };
    let dy = if last { &b.dout } else { &dh_hi[0] };
    let args = ConvBnBackwardArgs {
        x: x.as_view(),
        w: b.w[i].as_view(),
        z: b.a[i].as_view(),
        y: rest[0].as_view(),
        dy: dy.as_view(),
        gamma: b.gamma[i].as_view(),
        beta: b.beta[i].as_view(),
        saved,
        dz: b.da[i].as_view_mut(),
        dx: Some(dx.as_view_mut()),
        accumulate_dx: false,
        dw: b.dw[i].as_view_mut(),
        dgamma: b.dgamma[i].as_view_mut(),
        dbeta: b.dbeta[i].as_view_mut(),
        d_addend: last.then(|| b.dx.as_view_mut()),
    };
    match l.given_fold[i] {
        Some(folded) => u.backward_with(folded, args),
        None => u.backward(args),
    }
}

/// Runs one operation of the step, letting an undecided unit decide at its `convN.fwd` (the
/// first step's). `st` carries BatchNorm's forward state to its backward.
fn run_op<T: Element>(l: &Layers<T>, b: &mut Buffers<T>, op: Op, st: &mut StepState) -> Result<()> {
    if let Op::ConvFwd(i) = op {
        if let Some(u) = l.undecided_unit(i) {
            let saved = decide_unit(l, b, i, u)
                .with_context(|| format!("unit {} (conv{} and bn{})", i + 1, i + 1, i + 1))?;
            st.saved[i] = Some(Saved::Unit(saved));
            st.bn_ran[i] = true;
            return Ok(());
        }
    }
    Ok(queue_op(l, b, op, st)?)
}

/// Queues one operation of the step (decided: no measurement of its own here).
fn queue_op<T: Element>(
    l: &Layers<T>,
    b: &mut Buffers<T>,
    op: Op,
    st: &mut StepState,
) -> nnfuse::Result<()> {
    let ctx = &l.ctx;
    let forced = l.conv_route(op);
    match op {
        Op::ConvFwd(i) => {
            st.done[i] = conv_fwd(l, b, i, l.fused_unit(i))?;
            Ok(())
        }
        Op::ConvDgrad(i) | Op::ConvWgrad(i) if st.grads_ran[i] => Ok(()),
        Op::ConvDgrad(0) if l.variant.adds_dx_in_place() => {
            // dx holds the shortcut's gradient (bn3.bwd's d_addend): add conv1's to it. A
            // forced route that cannot add gives way to the dispatcher's accumulating route.
            let conv = &l.convs[0];
            let plan = conv.plan_for(Direction::BackwardData);
            match forced.filter(|r| plan.accumulate_refusal(r.path).is_none()) {
                Some(r) => conv.backward_data_with_into(r, &b.da[0], &b.w[0], &mut b.dx, true),
                None => conv.backward_data_into(&b.da[0], &b.w[0], &mut b.dx, true),
            }
        }
        Op::ConvDgrad(i) => {
            let dx = if i == 0 {
                &mut b.dx_conv
            } else {
                &mut b.dh[i - 1]
            };
            match forced {
                Some(r) => l.convs[i].backward_data_with(r, &b.da[i], &b.w[i], dx),
                None => l.convs[i].backward_data(&b.da[i], &b.w[i], dx),
            }
        }
        Op::ConvWgrad(i) => {
            let x = if i == 0 { &b.x } else { &b.h[i - 1] };
            match forced {
                Some(r) => l.convs[i].backward_filter_with(r, x, &b.da[i], &mut b.dw[i], false),
                None => l.convs[i].backward_filter(x, &b.da[i], &mut b.dw[i], false),
            }
        }
        // A unit's deciding first forward ran this BatchNorm already.
        Op::BnFwd(i) if std::mem::take(&mut st.bn_ran[i]) => Ok(()),
        Op::BnFwd(i) => {
            st.saved[i] = Some(bn_fwd(l, b, i, st.done[i].take())?);
            Ok(())
        }
        Op::BnBwd(i) => {
            let Some(s) = st.saved[i].take() else {
                return Err(nnfuse::Error::invalid(
                    "saved",
                    format!("{} ran without its forward", op.name()),
                ));
            };
            let last = i == 2;
            if let (Saved::Unit(t), Some(u)) = (&s, l.unit_backward(i)) {
                st.grads_ran[i] = true;
                return unit_backward(l, b, i, u, t);
            }
            let dy = if last { &b.dout } else { &b.dh[i] };
            if l.variant.fuse(i) != Fuse::None {
                let (saved, unit) = match &s {
                    Saved::Plain(s) => (s, None),
                    Saved::Unit(t) => (t.bn(), l.units[i].as_ref().ok()),
                };
                let args = BackwardArgs {
                    x: b.a[i].as_view(),
                    y: b.h[i].as_view(),
                    dy: dy.as_view(),
                    gamma: b.gamma[i].as_view(),
                    beta: b.beta[i].as_view(),
                    saved,
                    dx: b.da[i].as_view_mut(),
                    d_addend: last.then(|| b.dx.as_view_mut()),
                    dgamma: b.dgamma[i].as_view_mut(),
                    dbeta: b.dbeta[i].as_view_mut(),
                };
                // A unit's state goes back to the unit (the fused route's is its own
                // BatchNorm's).
                match unit {
                    Some(u) => u.backward_bn(args),
                    None => l.bns[i].backward(args),
                }
            } else {
                let Saved::Plain(s) = s else {
                    return Err(nnfuse::Error::invalid(
                        "saved",
                        "a unit's state in a composition without units",
                    ));
                };
                // ReLU's backward from y (into the shortcut's gradient for the last BN), then
                // BatchNorm's.
                let g = if last { &mut b.dx } else { &mut b.relu_grad };
                activation::baseline::relu_bwd_from_y(ctx, dy, &b.h[i], g)?;
                l.bns[i].backward(BackwardArgs {
                    x: b.a[i].as_view(),
                    y: b.h[i].as_view(),
                    dy: g.as_view(),
                    gamma: b.gamma[i].as_view(),
                    beta: b.beta[i].as_view(),
                    saved: &s,
                    dx: b.da[i].as_view_mut(),
                    d_addend: None,
                    dgamma: b.dgamma[i].as_view_mut(),
                    dbeta: b.dbeta[i].as_view_mut(),
                })
            }
        }
        // conv1.dgrad added into dx already.
        Op::AddDx if l.variant.adds_dx_in_place() => Ok(()),
        Op::AddDx => util::add_assign(ctx, &mut b.dx, &b.dx_conv),
        Op::FcFwd => {
            gemm::strided_batched(ctx, &l.def.fc_problem(op), &b.fc_w, &b.feat, &mut b.logits)
        }
        Op::FcWgrad => gemm::strided_batched(
            ctx,
            &l.def.fc_problem(op),
            &b.feat,
            &b.dlogits,
            &mut b.fc_dw,
        ),
        Op::FcDgrad => gemm::strided_batched(
            ctx,
            &l.def.fc_problem(op),
            &b.fc_w,
            &b.dlogits,
            &mut b.dfeat,
        ),
    }
}

/// Queues one training step; `mark(op)` runs after each operation is queued.
pub fn run_step<T: Element>(
    l: &Layers<T>,
    b: &mut Buffers<T>,
    mark: &mut dyn FnMut(Op) -> Result<()>,
) -> Result<()> {
    if b.def != l.def {
        bail!(
            "the buffers are for batch {}, the layers for batch {}",
            b.def.n,
            l.def.n
        );
    }
    let mut st = StepState::default();
    for op in STEP {
        run_op(l, b, op, &mut st)
            .with_context(|| format!("{} ({})", op.name(), l.variant.name()))?;
        mark(op)?;
    }
    Ok(())
}

/// Queues the classifier's three GEMMs alone.
pub fn run_classifier<T: Element>(l: &Layers<T>, b: &mut Buffers<T>) -> Result<()> {
    let mut st = StepState::default();
    for op in [Op::FcFwd, Op::FcWgrad, Op::FcDgrad] {
        run_op(l, b, op, &mut st)
            .with_context(|| format!("{} ({})", op.name(), l.variant.name()))?;
    }
    Ok(())
}

/// Runs one untimed step and waits for it; returns its wall time in ms (a first step includes
/// every first-call cost: `auto`'s measurements, GEMM searches, handles, NVRTC compiles).
pub fn wall_step<T: Element>(l: &Layers<T>, b: &mut Buffers<T>) -> Result<f64> {
    let t = Instant::now();
    run_step(l, b, &mut |_| Ok(()))?;
    l.ctx.synchronize()?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// Host time (ms) to queue one step, without waiting for the GPU.
pub fn host_queue_ms<T: Element>(l: &Layers<T>, b: &mut Buffers<T>) -> Result<f64> {
    l.ctx.synchronize()?;
    let t = Instant::now();
    run_step(l, b, &mut |_| Ok(()))?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    l.ctx.synchronize()?;
    Ok(ms)
}

/// Wall-clock time per step (ms) of `steps` steps queued back to back with no synchronisation
/// between them and one at the end: what a training loop runs at (the slower of the host's
/// queueing and the GPU's work, plus the first step's queueing spread over the loop).
pub fn loop_ms<T: Element>(l: &Layers<T>, b: &mut Buffers<T>, steps: usize) -> Result<f64> {
    l.ctx.synchronize()?;
    let t = Instant::now();
    for _ in 0..steps {
        run_step(l, b, &mut |_| Ok(()))?;
    }
    l.ctx.synchronize()?;
    Ok(t.elapsed().as_secs_f64() * 1e3 / steps.max(1) as f64)
}

/// A CUDA event that records timing.
pub fn new_event(ctx: &Context) -> Result<CudaEvent> {
    Ok(ctx
        .cuda()
        .new_event(Some(drv::CUevent_flags::CU_EVENT_DEFAULT))?)
}

/// The GPU's head start: work queued before a timed step so that the host has queued the whole
/// step before the GPU reaches it, and the events measure the operations back to back rather
/// than the host's pace.
pub struct HeadStart {
    buf: CudaSlice<f32>,
    /// Fills of `buf` per head start.
    pub fills: usize,
    /// GPU time of one fill (ms).
    pub fill_ms: f64,
}

impl HeadStart {
    /// The most fills of one head start.
    pub const MAX_FILLS: usize = 5000;

    /// A 256 MiB buffer, one fill timed, and enough fills to cover `host_ms` of queueing twice
    /// over (plus 0.5 ms).
    pub fn new(ctx: &Context, host_ms: f64) -> Result<HeadStart> {
        let mut buf = zeros::<f32>(ctx, 64 << 20)?;
        util::fill(ctx, &mut buf, 0.0)?;
        let (a, b) = (new_event(ctx)?, new_event(ctx)?);
        a.record(ctx.stream())?;
        util::fill(ctx, &mut buf, 0.0)?;
        b.record(ctx.stream())?;
        b.synchronize()?;
        let fill_ms = (a.elapsed_ms(&b)? as f64).max(1e-3);
        let fills = ((2.0 * host_ms + 0.5) / fill_ms)
            .ceil()
            .clamp(1.0, Self::MAX_FILLS as f64) as usize;
        Ok(HeadStart {
            buf,
            fills,
            fill_ms,
        })
    }

    /// Queues the fills.
    pub fn queue(&mut self, ctx: &Context) -> Result<()> {
        for _ in 0..self.fills {
            util::fill(ctx, &mut self.buf, 0.0)?;
        }
        Ok(())
    }
}

/// The events of one timed step: one before the step and one after each operation (created
/// once and reused by every timed step: creating and destroying 20 events per step is driver
/// work between the steps that a training loop does not do).
pub fn step_events(ctx: &Context) -> Result<Vec<CudaEvent>> {
    (0..=STEP.len()).map(|_| new_event(ctx)).collect()
}

/// One timed step: waits for the GPU, queues the head start, then the step with an event after
/// every operation (`events`, from [`step_events`]), and reads the events.
pub fn timed_step<T: Element>(
    l: &Layers<T>,
    b: &mut Buffers<T>,
    head: &mut HeadStart,
    events: &[CudaEvent],
) -> Result<StepTimes> {
    let ctx = &l.ctx;
    let stream = ctx.stream();
    if events.len() != STEP.len() + 1 {
        bail!("{} events for {} operations", events.len(), STEP.len());
    }
    ctx.synchronize()?;
    head.queue(ctx)?;
    events[0].record(stream)?;
    let t = Instant::now();
    let mut k = 1;
    run_step(l, b, &mut |_| {
        let e = events
            .get(k)
            .ok_or_else(|| anyhow!("more operations than events"))?;
        e.record(stream)?;
        k += 1;
        Ok(())
    })?;
    let host_ms = t.elapsed().as_secs_f64() * 1e3;
    let last = &events[STEP.len()];
    last.synchronize()?;
    let mut ops_ms = Vec::with_capacity(STEP.len());
    for i in 0..STEP.len() {
        ops_ms.push(events[i].elapsed_ms(&events[i + 1])? as f64);
    }
    Ok(StepTimes {
        ops_ms,
        total_ms: events[0].elapsed_ms(last)? as f64,
        host_ms,
        bare_ms: None,
    })
}

/// The same step queued again behind a head start with only two events, before and after it
/// (`events[0]` and the last): its GPU time without the events between operations, ms.
pub fn bare_step<T: Element>(
    l: &Layers<T>,
    b: &mut Buffers<T>,
    head: &mut HeadStart,
    events: &[CudaEvent],
) -> Result<f64> {
    let ctx = &l.ctx;
    let (Some(first), Some(last)) = (events.first(), events.last()) else {
        bail!("no events");
    };
    ctx.synchronize()?;
    head.queue(ctx)?;
    first.record(ctx.stream())?;
    run_step(l, b, &mut |_| Ok(()))?;
    last.record(ctx.stream())?;
    last.synchronize()?;
    Ok(first.elapsed_ms(last)? as f64)
}

/// The decisions of every operation of `l` (after a first step).
pub fn decisions<T: Element>(l: &Layers<T>, b: &Buffers<T>) -> Vec<Decision> {
    STEP.iter()
        .map(|&op| {
            let (route, detail) =
                with_unit_backward(l, op, with_unit(l, op, decide_text(l, b, op)));
            Decision { op, route, detail }
        })
        .collect()
}

/// A unit's whole backward at `bnN.bwd` (its convolution's gradients inside it): what runs and
/// how the unit decided; `convN.dgrad` / `convN.wgrad` say where their work went.
fn with_unit_backward<T: Element>(
    l: &Layers<T>,
    op: Op,
    (route, detail): (String, String),
) -> (String, String) {
    let i = match op {
        Op::BnBwd(i) | Op::ConvDgrad(i) | Op::ConvWgrad(i) => i,
        _ => return (route, detail),
    };
    let Some(u) = l.unit_backward(i) else {
        return (route, detail);
    };
    let n = i + 1;
    let how = if l.unit_folds(i) {
        "folded"
    } else {
        "composed"
    };
    match op {
        Op::BnBwd(_) => (
            format!("unit_backward/{how}"),
            format!(
                "the unit's whole backward (bn{n}.bwd, conv{n}.dgrad, conv{n}.wgrad) at \
                 bn{n}.bwd: {}; its BatchNorm: {detail}",
                u.backward_decision()
            ),
        ),
        _ => (
            format!("in bn{n}.bwd ({how})"),
            format!(
                "runs inside bn{n}.bwd's unit backward (its GPU time is counted there); the \
                 convolution's own decision: {route}: {detail}"
            ),
        ),
    }
}

/// nnfuse's fused units in `op`'s decision (`convN.fwd`, `bnN.fwd`, `bnN.bwd`): where unit N
/// runs fused, what runs instead of the layer's own decision (`route`, `detail`), with both
/// timings; where it does not, the layer's decision with why not.
fn with_unit<T: Element>(
    l: &Layers<T>,
    op: Op,
    (route, detail): (String, String),
) -> (String, String) {
    let i = match op {
        Op::ConvFwd(i) | Op::BnFwd(i) | Op::BnBwd(i) if l.variant == Variant::Nnfuse => i,
        _ => return (route, detail),
    };
    let (Some(u), Some(c)) = (l.fused_unit(i), l.unit_choice(i)) else {
        let why = match (l.unit(i), l.unit_choice(i)) {
            (Err(why), _) => format!("no fused unit: {why}"),
            (Ok(_), Some(c)) => units::describe(&c, i),
            (Ok(_), None) => "fused unit not decided yet".into(),
        };
        return match op {
            Op::BnBwd(_) => (route, detail),
            _ => (route, format!("{detail}; {why}")),
        };
    };
    let n = i + 1;
    let Some(p) = u.batchnorm(TrainRoute::Fused).map(|bn| bn.plan()) else {
        return (route, detail);
    };
    let fuse = BlockDef::bn_fuse(i).describe();
    match op {
        Op::ConvFwd(_) => {
            let sc = u.stats_choice();
            let r = sc.as_ref().map_or(StatsRoute::Unfused, |s| s.route);
            let mut d = format!(
                "{}; ConvStats: conv{n} and its output's per-channel sum and sum of squares",
                units::describe(&c, i)
            );
            if let Some(sc) = sc.filter(|s| !s.times_us.is_empty()) {
                let t: Vec<String> = sc
                    .times_us
                    .iter()
                    .map(|(name, us)| format!("{name} {us:.1} us"))
                    .collect();
                d.push_str(&format!(" (its routes measured: {})", t.join(", ")));
            }
            if r == StatsRoute::Unfused {
                d.push_str(&format!("; its convolution: {route}, {detail}"));
            }
            (format!("conv_stats/{r}"), d)
        }
        Op::BnFwd(_) => (
            format!("own_from_sums/{}", p.mode.name()),
            format!(
                "nnfuse's own {fuse} from conv{n}'s sums: statistics finalized per channel, then \
                 normalisation, activation and bitmask in one pass (BnImpl::Own; {}, {} API)",
                p.mode.name(),
                p.api
            ),
        ),
        _ => (
            format!("own/{}", p.mode.name()),
            format!(
                "nnfuse's own {fuse} backward: the fused unit's BatchNorm (own path), whose \
                 state forward_train_from_sums made"
            ),
        ),
    }
}

fn decide_text<T: Element>(l: &Layers<T>, b: &Buffers<T>, op: Op) -> (String, String) {
    if let Some((i, d)) = op.conv() {
        return match l.decision(i, d) {
            Some(c) => {
                let mut detail = format!("{} ({})", c.origin.name(), c);
                if l.accumulates(i, d) {
                    detail.push_str("; decided for accumulating calls (added into dx)");
                }
                if let Some(r) = l.measurement(i, d) {
                    detail.push_str(&format!("; measured in {:.1} ms", r.wall_ms));
                }
                for n in &c.notes {
                    detail.push_str(&format!("; {n}"));
                }
                (c.route.label(), detail)
            }
            None => ("(undecided)".into(), "no call has run yet".into()),
        };
    }
    if let Some(i) = op.bn() {
        let p = l.bns[i].plan();
        let mode = format!("{}, {} API", p.mode.name(), p.api);
        return if l.variant.fuse(i) == Fuse::None {
            let act = match (op, BlockDef::bn_fuse(i)) {
                (Op::BnFwd(_), Fuse::AddRelu) => "plain BN, then add and ReLU kernels",
                (Op::BnFwd(_), _) => "plain BN, then a ReLU kernel",
                (_, _) => "ReLU backward from y, then plain BN backward",
            };
            (
                format!("plain/{}", p.mode.name()),
                format!("{act} ({mode})"),
            )
        } else {
            let path = l.bns[i].training_path();
            let what = match path {
                nnfuse::batchnorm::BnPath::CudnnFused => {
                    format!("cuDNN's fused {}", BlockDef::bn_fuse(i).describe())
                }
                nnfuse::batchnorm::BnPath::Own => format!(
                    "nnfuse's own {} kernels (statistics, then normalisation, activation and \
                     bitmask in one pass)",
                    BlockDef::bn_fuse(i).describe()
                ),
                _ => format!(
                    "cuDNN BN, then nnfuse's bitmask {} kernel (fusion refused: {})",
                    if BlockDef::bn_fuse(i) == Fuse::AddRelu {
                        "Add+ReLU"
                    } else {
                        "ReLU"
                    },
                    p.refusals
                        .iter()
                        .map(|r| r.code())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            (
                format!("{path}/{}", p.mode.name()),
                format!("{what} ({mode})"),
            )
        };
    }
    if op.is_fc() {
        let p = l.def.fc_problem(op);
        let (a, bb, c) = match op {
            Op::FcFwd => (&b.fc_w, &b.feat, &b.logits),
            Op::FcWgrad => (&b.feat, &b.dlogits, &b.fc_dw),
            _ => (&b.fc_w, &b.dlogits, &b.dfeat),
        };
        if !l.ctx.config().gemm_search {
            return (
                "cublas_default".into(),
                "cublasGemmStridedBatchedEx, CUBLAS_GEMM_DEFAULT (search off)".into(),
            );
        }
        let choice = gemm::key_for(&l.ctx, &p, a, bb, c)
            .ok()
            .and_then(|k| gemm::lookup(&k));
        return match choice {
            Some(ch) => {
                let short = match ch.algo {
                    Algo::Lt(_) => "cublaslt_tuned",
                    Algo::Cublas(_) => "cublas_default",
                };
                let mut detail = ch.label();
                if ch.median_us.is_finite() {
                    detail.push_str(&format!(
                        "; searched: {:.1} us against the default's {:.1} us among {} candidates",
                        ch.median_us, ch.default_us, ch.candidates
                    ));
                }
                (short.into(), detail)
            }
            None => ("(unknown)".into(), "no tuned choice cached".into()),
        };
    }
    (
        "add_kernel".into(),
        "nnfuse::internals::util::add_assign (f32 sum, one rounding)".into(),
    )
}

/// One demo run on the GPU: the timed batch's buffers and every variant's layers, kept across
/// the warm-up, the check and the timed steps.
pub struct Session<T: Element> {
    ctx: Context,
    def: BlockDef,
    seed: u64,
    big: Buffers<T>,
    layers: Vec<Layers<T>>,
}

impl<T: Element> Session<T> {
    /// Allocates and fills the timed batch's tensors and plans every variant's layers (each on
    /// a Context that shares `ctx`'s device and stream and decides with the variant's
    /// configuration).
    pub fn new(ctx: &Context, def: &BlockDef, seed: u64) -> Result<Self> {
        let mut big = Buffers::<T>::new(ctx, def)?;
        big.fill_random(ctx, seed)?;
        let mut layers = Vec::new();
        for v in Variant::ALL {
            let vctx = if v == Variant::Nnfuse {
                ctx.clone()
            } else {
                ctx.with_config_override(v.config(ctx.config()))
            };
            layers.push(Layers::<T>::new(&vctx, def, v)?);
        }
        Ok(Session {
            ctx: ctx.clone(),
            def: *def,
            seed,
            big,
            layers,
        })
    }

    /// Every variant's first step (timed by the wall clock: every first-call cost), then two
    /// more untimed steps each (after the units' fused kernels are loaded: a unit decided
    /// provisionally on the first step decides on the next); returns the runs with their
    /// decisions as they stand after those steps, and the longest host time to queue a step
    /// (ms).
    pub fn warm_up(&mut self, bar: &indicatif::ProgressBar) -> Result<(Vec<VariantRun>, f64)> {
        let mut runs = Vec::new();
        for l in &self.layers {
            bar.set_message(format!(
                "first step, {} (auto measurements, GEMM searches)",
                l.variant.title()
            ));
            let first_step_ms = wall_step(l, &mut self.big)?;
            let mut conv_measure_ms = 0.0;
            for c in &l.convs {
                for d in Direction::ALL {
                    for accumulate in [false, true] {
                        conv_measure_ms += c.report_for(d, accumulate).map_or(0.0, |r| r.wall_ms);
                    }
                }
            }
            runs.push(VariantRun {
                variant: l.variant,
                first_step_ms,
                conv_measure_ms,
                // Filled in after the warm-up steps (a unit decided provisionally on the
                // first step decides for good on the next).
                decisions: Vec::new(),
                times: Vec::new(),
                loop_ms: Vec::new(),
                host_step_ms: Vec::new(),
                host_busy_ms: Vec::new(),
                host_busy_idle: 0,
            });
            bar.inc(1);
        }
        let mut host_ms: f64 = 0.0;
        for (l, run) in self.layers.iter().zip(runs.iter_mut()) {
            bar.set_message(format!("warm-up steps, {}", l.variant.title()));
            l.load_unit_kernels()?;
            for _ in 0..2 {
                wall_step(l, &mut self.big)?;
            }
            run.decisions = decisions(l, &self.big);
            host_ms = host_ms.max(host_queue_ms(l, &mut self.big)?);
        }
        Ok((runs, host_ms))
    }

    /// The check at `batch`: every variant's step on fresh random inputs with the convolution
    /// routes the timed batch decided (forced), each output against f64; and the classifier's
    /// GEMMs at the timed batch.
    pub fn check(&mut self, batch: usize, bar: &indicatif::ProgressBar) -> Result<CheckReport> {
        let ctx = self.ctx.clone();
        let cdef = self.def.with_batch(batch);
        let round = |v: f64| T::from_f64(v).to_f64();
        let inp = random_inputs(&cdef, self.seed ^ 0x5EED_C0DE, &round)?;
        let mut small = Buffers::<T>::new(&ctx, &cdef)?;
        let fc_inp = self.big.download_classifier_inputs(&ctx)?;
        let mut report = CheckReport {
            batch,
            rows: Vec::new(),
            notes: Vec::new(),
        };
        for l in &self.layers {
            bar.set_message(format!("check at batch {batch}, {}", l.variant.title()));
            let mut cl = Layers::<T>::new(&l.ctx, &cdef, l.variant)?;
            cl.force(l.decided_routes());
            // The fused units as the timed batch decided, on its ConvStats routes (ConvStats'
            // inner convolution decides at this batch: it takes no forced route).
            cl.give_units(l);
            small.upload_and_poison(&ctx, &inp)?;
            if let Err(e) = run_step(&cl, &mut small, &mut |_| Ok(())) {
                // A route of the timed batch that this batch cannot take: check the dispatcher's
                // own decisions here instead, and say so.
                report.notes.push(format!(
                    "{}: the timed batch's routes could not run at batch {batch} ({e:#}); this \
                     batch's own decisions were checked",
                    l.variant.title()
                ));
                cl.force([[None; 3]; 3]);
                cl.unforce_stats();
                small.upload_and_poison(&ctx, &inp)?;
                run_step(&cl, &mut small, &mut |_| Ok(()))?;
            }
            let fused: Vec<String> = (0..3)
                .filter(|&i| cl.fused_unit(i).is_some())
                .map(|i| format!("conv{n}+bn{n}", n = i + 1))
                .collect();
            if !fused.is_empty() {
                report.notes.push(format!(
                    "{}: fused units {} checked as they ran (ConvStats, then BatchNorm from its \
                     sums); ConvStats' convolution decides at batch {batch} itself (it takes no \
                     forced route), its route gives conv.fwd's tolerance",
                    l.variant.title(),
                    fused.join(", ")
                ));
            }
            let out = small.download_outputs(&ctx)?;
            let tol = |op: Op| tolerance(op, T::DTYPE, op.conv().and_then(|(i, d)| cl.route(i, d)));
            let folded = [0, 1, 2].map(|i| cl.unit_folds(i));
            let mut rows = check_step(
                &cdef,
                &inp,
                &out,
                &tol,
                l.variant.adds_dx_in_place(),
                folded,
            )?;
            // The classifier at the timed batch (its GEMM algorithms are chosen per shape).
            self.big.poison_classifier(&ctx)?;
            run_classifier(l, &mut self.big)?;
            let fc_out = self.big.download_classifier_outputs(&ctx)?;
            rows.retain(|r| !r.op.is_fc());
            rows.extend(check_classifier(&self.def, &fc_inp, &fc_out, &tol));
            report.rows.push((l.variant, rows));
            bar.inc(1);
        }
        Ok(report)
    }

    /// What a training loop runs at, per variant (interleaved, the order rotating): one loop
    /// of `steps` steps not counted, then `loops` loops each giving the wall-clock time per
    /// step; and the host time to queue one step, `steps` times, each right after a synchronize
    /// (the GPU idle, so no call waits for it). Into `runs`.
    pub fn loops(
        &mut self,
        steps: usize,
        loops: usize,
        runs: &mut [VariantRun],
        bar: &indicatif::ProgressBar,
    ) -> Result<()> {
        let n = self.layers.len();
        for l in &self.layers {
            loop_ms(l, &mut self.big, steps)?;
        }
        for k in 0..loops {
            bar.set_message(format!("loop {}/{loops} of {steps} steps", k + 1));
            for j in 0..n {
                let l = &self.layers[(k + j) % n];
                let ms = loop_ms(l, &mut self.big, steps)?;
                if let Some(r) = runs.iter_mut().find(|r| r.variant == l.variant) {
                    r.loop_ms.push(ms);
                }
                bar.inc(1);
            }
        }
        bar.set_message("host time per step");
        for s in 0..steps {
            for j in 0..n {
                let l = &self.layers[(s + j) % n];
                let ms = host_queue_ms(l, &mut self.big)?;
                if let Some(r) = runs.iter_mut().find(|r| r.variant == l.variant) {
                    r.host_step_ms.push(ms);
                }
            }
        }
        Ok(())
    }

    /// The host time to queue one step while the GPU is busy, per variant (interleaved, the
    /// order rotating), `steps` samples each, behind a head start covering the longest host
    /// time measured after a synchronize (see [`super::host::BusyGpu`]). Into `runs`; returns
    /// the head start for the profiled pass.
    pub fn busy_host(&mut self, steps: usize, runs: &mut [VariantRun]) -> Result<BusyGpu> {
        let host_ms = runs
            .iter()
            .flat_map(|r| r.host_step_ms.iter().copied())
            .fold(0.0, f64::max);
        let mut busy = BusyGpu::new(&self.ctx, host_ms)?;
        let n = self.layers.len();
        for s in 0..steps {
            for j in 0..n {
                let l = &self.layers[(s + j) % n];
                let (ms, stayed) = busy_step_ms(&mut busy, l, &mut self.big)?;
                if let Some(r) = runs.iter_mut().find(|r| r.variant == l.variant) {
                    r.host_busy_ms.push(ms);
                    r.host_busy_idle += usize::from(!stayed);
                }
            }
        }
        Ok(busy)
    }

    /// `--profile-host`: `steps` more steps of nnfuse's variant while the GPU is busy, with the
    /// library's stage profiler on; see [`super::host::profile_steps`].
    pub fn profile_host(&mut self, steps: usize, busy: &mut BusyGpu) -> Result<HostProfile> {
        let l = self
            .layers
            .iter()
            .find(|l| l.variant == Variant::Nnfuse)
            .ok_or_else(|| anyhow!("no nnfuse layers"))?;
        profile_steps(busy, l, &mut self.big, steps)
    }

    /// `--graph`: nnfuse's step captured, replayed, checked bit for bit against eager steps
    /// and (when identical) timed; see [`super::graph::run`].
    pub fn graph(&mut self, steps: usize, loops: usize) -> Result<GraphReport> {
        let l = self
            .layers
            .iter()
            .find(|l| l.variant == Variant::Nnfuse)
            .ok_or_else(|| anyhow!("no nnfuse layers"))?;
        super::graph::run(l, &mut self.big, steps, loops)
    }

    /// `steps` timed steps of every variant, interleaved (the order rotates every step); the
    /// times go into `runs`. Returns the head start (fills, ms per fill).
    pub fn time(
        &mut self,
        steps: usize,
        host_ms: f64,
        runs: &mut [VariantRun],
        bar: &indicatif::ProgressBar,
    ) -> Result<(usize, f64)> {
        let mut head = HeadStart::new(&self.ctx, host_ms)?;
        let events = step_events(&self.ctx)?;
        let n = self.layers.len();
        for s in 0..steps {
            bar.set_message(format!("timed step {}/{steps}", s + 1));
            for k in 0..n {
                let v = (s + k) % n;
                let mut t = timed_step(&self.layers[v], &mut self.big, &mut head, &events)?;
                t.bare_ms = Some(bare_step(
                    &self.layers[v],
                    &mut self.big,
                    &mut head,
                    &events,
                )?);
                if let Some(r) = runs
                    .iter_mut()
                    .find(|r| r.variant == self.layers[v].variant)
                {
                    r.times.push(t);
                }
                bar.inc(1);
            }
        }
        Ok((head.fills, head.fill_ms))
    }
}
