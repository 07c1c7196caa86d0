//! [`BatchNorm::forward_train_from_sums`]: the training forward of the own path with the
//! statistics pass replaced by per-channel sums computed elsewhere (ConvStats: in the
//! convolution's epilogue). On the channels-last vector path (any alignment-suitable NHWC
//! tensor of at most `STAGE_MAX_C` channels) that is one launch: each block of the elementwise
//! pass stages the coefficients from the sums and block 0 writes the saved and running
//! statistics (`own::apply_train_from_sums`). Elsewhere a finalize of one thread per channel
//! (`kernels/block_stats.cu`) runs first, then the own path's elementwise pass. Both use the own
//! statistics' f64 arithmetic (the same bits). The state it returns is an own-path state, which
//! the existing backward takes unchanged.

use cudarc::driver::{CudaView, DeviceRepr};

use crate::batchnorm::args::TrainArgs;
use crate::batchnorm::ops::{check_addend, check_scalars, BatchNorm, Ran};
use crate::batchnorm::own::{self, FwdBufs};
use crate::batchnorm::state::BnSaved;
use crate::batchnorm::types::{BnPath, OwnVariant, Phase};
use crate::context::Context;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::kernels;
use crate::launch;
use crate::validate::{Aliasing, Binder, Need};

/// `bn_finalize_from_sums`' argument (`struct FromSumsArgs` of `kernels/block_stats.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FromSumsArgs {
    pub(crate) sum: u64,
    pub(crate) sqsum: u64,
    /// The sums' low words (0: none).
    pub(crate) sum_lo: u64,
    pub(crate) sqsum_lo: u64,
    pub(crate) saved_mean: u64,
    pub(crate) saved_mean_lo: u64,
    pub(crate) saved_invstd: u64,
    pub(crate) running_mean: u64,
    pub(crate) running_var: u64,
    pub(crate) count: f64,
    pub(crate) channels: u32,
    pub(crate) eps: f32,
    pub(crate) momentum: f64,
}

// SAFETY: plain old data laid out as the kernel's struct (checked by the test below).
unsafe impl DeviceRepr for FromSumsArgs {}

/// Saved mean (hi, lo), saved inverse std and running statistics from the sums.
///
/// # Safety
/// Every address in `a` holds `a.channels` f32s on the Context's device, the outputs disjoint
/// from each other and the inputs, valid until the queued work completes; `a.count > 1`.
pub(crate) unsafe fn finalize(ctx: &Context, a: &FromSumsArgs) -> Result<()> {
    let f = ctx.function(&kernels::BLOCK_STATS, "bn_finalize_from_sums")?;
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (a.channels.div_ceil(128).max(1), 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: FromSumsArgs is the kernel's struct; the addresses as the caller's contract says.
    unsafe {
        launch::launch_kernel(
            ctx,
            &f,
            cfg,
            &mut [launch::arg(a)],
            "cuLaunchKernel(bn_finalize_from_sums)",
        )
    }
}

impl<T: Element> BatchNorm<T> {
    /// Training forward from precomputed per-channel statistics of `a.x`: `sum[c] = Σ x` and
    /// `sqsum[c] = Σ x²` over the `M` values of channel `c` (f32, length C; e.g. written by
    /// [`ConvStats`](crate::block::ConvStats) in the convolution that produced x). The batch
    /// mean is `sum / M`, the biased variance `sqsum / M − mean²` (clamped at 0; in f64, but
    /// from f32 sums it loses about `E[x²] / var` of f32's precision where the mean is large
    /// against the spread). Sums of length 2·C carry low words in their second half (`Σ x =
    /// sum[c] + sum[C + c]`, about 48 bits), which keep the statistics within 1e-6 of f64 on
    /// such data: nnfuse's fused training unit hands its sums over this way for f32. The running
    /// statistics move as [`BatchNorm::forward_train`]'s (momentum, unbiased variance `M / (M −
    /// 1)` times the biased one, in f64). Then y (and the ReLU / Add+ReLU bitmask) in one pass
    /// over x, exactly as the own path's second pass: no statistics pass over x.
    ///
    /// The returned state is an own-path state (its saved mean and inverse std where the own
    /// backward reads them), so [`BatchNorm::backward`] works on it unchanged.
    ///
    /// Only for a BatchNorm whose training plan takes nnfuse's own kernels
    /// ([`BnPath::Own`], e.g. `Config::with_bn_impl(BnImpl::Own)`); any other plan is an
    /// [`Error::NotSupported`] saying which path it took. Channels are the plan's (any layout).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use nnfuse::batchnorm::{BatchNorm, Fuse, TrainArgs};
    /// use nnfuse::{BnImpl, Config, Context};
    /// let ctx = Context::with_config(0, Config::default().with_bn_impl(BnImpl::Own))?;
    /// let shape = [8, 14, 14, 64];
    /// let bn = BatchNorm::<half::f16>::new(&ctx, &shape, 3, Fuse::Relu)?;
    /// let s = ctx.stream();
    /// let n: usize = shape.iter().product();
    /// let x = s.clone_htod(&vec![half::f16::from_f32(0.5); n])?;
    /// // Σx and Σx² per channel, e.g. from ConvStats::forward.
    /// let sum = s.clone_htod(&[0.5f32 * 1568.0; 64])?;
    /// let sqsum = s.clone_htod(&[0.25f32 * 1568.0; 64])?;
    /// let mut y = s.alloc_zeros::<half::f16>(n)?;
    /// let (g, b) = (s.clone_htod(&[1.0f32; 64])?, s.alloc_zeros::<f32>(64)?);
    /// let (mut rm, mut rv) = (s.alloc_zeros::<f32>(64)?, s.clone_htod(&[1.0f32; 64])?);
    /// let saved = bn.forward_train_from_sums(TrainArgs {
    ///     x: x.as_view(), addend: None, gamma: g.as_view(), beta: b.as_view(),
    ///     running_mean: rm.as_view_mut(), running_var: rv.as_view_mut(),
    ///     y: y.as_view_mut(), momentum: 0.1, eps: 1e-5,
    /// }, &sum.as_view(), &sqsum.as_view())?;
    /// # drop(saved); Ok(()) }
    /// ```
    pub fn forward_train_from_sums(
        &self,
        mut a: TrainArgs<'_, T>,
        sum: &CudaView<'_, f32>,
        sqsum: &CudaView<'_, f32>,
    ) -> Result<BnSaved> {
        crate::profile::stage!(Call);
        let core = &*self.core;
        let path = core.train.path;
        if path != BnPath::Own {
            return Err(Error::NotSupported(format!(
                "forward_train_from_sums runs nnfuse's own BatchNorm kernels, but this \
                 BatchNorm's training plan takes the {path:?} path (plan it with \
                 BnImpl::Own): {}",
                core.train.reasons.join("; ")
            )));
        }
        check_scalars(a.eps, Some(a.momentum))?;
        check_addend(core.fuse, a.addend.is_some(), "addend")?;
        let m = core.train.layout.per_channel();
        if m < 2 {
            return Err(Error::invalid(
                "shape",
                "training needs more than one value per channel (n*h*w = 1)",
            ));
        }
        let st = self.alloc_train_state(BnPath::Own)?;
        let ctx = &self.ctx;
        let c = core.param_len(Phase::Training);
        let numel = Need::Exactly(self.numel(), "the shape's element count");
        let param = Need::Exactly(c, "the channel count");
        let mut ops = Binder::new(ctx);
        let x = ops.input("x", &a.x, numel)?;
        let gamma = ops.input("gamma", &a.gamma, param)?;
        let beta = ops.input("beta", &a.beta, param)?;
        // C f32s each, or 2·C: the second half holds the low words (`sum = hi + lo`).
        let low = c > 0 && sum.len() == 2 * c;
        let sums = match low {
            true => Need::Exactly(2 * c, "twice the channel count (high and low words)"),
            false => param,
        };
        let sum_p = ops.input("sum", sum, sums)?;
        let sqsum_p = ops.input("sqsum", sqsum, sums)?;
        let lo_words = |p: u64| if low { p + 4 * c as u64 } else { 0 };
        let z = match &a.addend {
            Some(v) => ops.input("addend", v, numel)?,
            None => 0,
        };
        let y = ops.output("y", &mut a.y, numel)?;
        let running_mean = ops.output("running_mean", &mut a.running_mean, param)?;
        let running_var = ops.output("running_var", &mut a.running_var, param)?;
        ops.check(Aliasing::Distinct)?;
        let mean_lo = st.mean_lo.as_ref().map_or(0, |o| o.ptr);
        let fin = FromSumsArgs {
            sum: sum_p,
            sqsum: sqsum_p,
            sum_lo: lo_words(sum_p),
            sqsum_lo: lo_words(sqsum_p),
            saved_mean: st.mean.ptr,
            saved_mean_lo: mean_lo,
            saved_invstd: st.inv_var.ptr,
            running_mean,
            running_var,
            count: m as f64,
            channels: u32::try_from(c)
                .map_err(|_| Error::invalid("shape", format!("{c} channels exceed u32")))?,
            eps: a.eps as f32,
            momentum: a.momentum,
        };
        let bufs = FwdBufs {
            x,
            z,
            y,
            mask: st.own_mask.as_ref().map_or(0, |o| o.ptr),
            gamma,
            beta,
            running_mean,
            running_var,
            saved_mean: st.mean.ptr,
            saved_mean_lo: mean_lo,
            saved_invstd: st.inv_var.ptr,
        };
        let one_launch;
        {
            crate::profile::stage!(Launch);
            let op = core.own_op(ctx, T::DTYPE);
            let sums = own::SumsIn {
                sum: sum_p,
                sqsum: sqsum_p,
                sum_lo: lo_words(sum_p),
                sqsum_lo: lo_words(sqsum_p),
                count: m as f64,
                momentum: a.momentum,
            };
            // One launch where the channels-last vector kernel can stage the statistics itself;
            // else the finalize, then the apply.
            one_launch = own::apply_train_from_sums(&op, &bufs, a.eps, &sums)?;
            if !one_launch {
                // SAFETY: every address validated above (lengths, device, outputs disjoint) or
                // the state's own C-float buffers; m > 1.
                unsafe { finalize(ctx, &fin) }?;
                own::apply_train(&op, &bufs, a.eps)?;
            }
        }
        tracing::debug!(path = "own", fuse = ?core.fuse, one_launch, "BatchNorm forward from sums");
        drop(ops);
        self.finish_train(&mut a, Ran::Own(OwnVariant::TwoPass), st, x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_finalize_argument_matches_the_kernel() {
        let src = kernels::BLOCK_STATS.source;
        let start = src.find("struct FromSumsArgs {").unwrap();
        let body = &src[start..];
        let body = &body[body.find('{').unwrap() + 1..body.find("};").unwrap()];
        let fields: Vec<&str> = body
            .lines()
            .map(|l| l.split("//").next().unwrap().trim())
            .filter(|l| !l.is_empty())
            .map(|l| l.trim_end_matches(';').rsplit([' ', '*']).next().unwrap())
            .collect();
        assert_eq!(
            fields,
            [
                "sum",
                "sqsum",
                "sum_lo",
                "sqsum_lo",
                "saved_mean",
                "saved_mean_lo",
                "saved_invstd",
                "running_mean",
                "running_var",
                "count",
                "channels",
                "eps",
                "momentum"
            ]
        );
        assert_eq!(std::mem::size_of::<FromSumsArgs>(), 96);
    }
}
