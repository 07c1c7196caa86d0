//! [`ConvBnInference`]: the folded `conv → BN → (+shortcut) → ReLU` of one problem, its
//! parameters (original and folded) and its decision per (shortcut, ReLU) combination.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

use super::cudnn_fused::CudnnFused;
use super::fold::{check_eps, fold, BnHost};
use super::lt_epilogue::EpilogueGemm;
use super::plan::{plan, BlockPlan, BlockRoute};
use crate::batchnorm::{BatchNorm, Fuse};
use crate::context::{cublaslt_present, cudnn_present, Context};
use crate::conv::{Conv2d, ConvShape};
use crate::dtype::Element;
use crate::error::{CallExt, Error, Result};
use crate::layout::TensorFormat;
use crate::validate::{Aliasing, Binder, Need};

/// The convolution's filter and the BatchNorm's inference parameters, on the Context's device:
/// `w` in the problem's filter layout (KCRS with NCHW, KRSC with NHWC), the four BatchNorm
/// vectors of length `c_out` in f32.
pub struct ConvBnParams<'a, T> {
    /// The convolution's filter.
    pub w: CudaView<'a, T>,
    /// BatchNorm scale γ.
    pub gamma: CudaView<'a, f32>,
    /// BatchNorm bias β.
    pub beta: CudaView<'a, f32>,
    /// Running mean.
    pub running_mean: CudaView<'a, f32>,
    /// Running variance.
    pub running_var: CudaView<'a, f32>,
    /// Added to the variance; finite and `> 0`.
    pub eps: f64,
}

/// How the first call of a (shortcut, ReLU) combination decided, or a forced fallback.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockChoice {
    /// The route later calls take.
    pub route: BlockRoute,
    /// GPU time per call (median, µs) of every route that was timed, the unfused first.
    pub times_us: Vec<(BlockRoute, f64)>,
    /// One line per fused candidate: its check and timing, or why it was dropped.
    pub notes: Vec<String>,
}

/// Descriptors made on first use: not yet, made, or why they could not be.
pub(super) type Made<D> = Option<std::result::Result<Arc<D>, String>>;

/// The decision slots: index `2 * shortcut + relu`.
pub(super) const fn slot(shortcut: bool, relu: bool) -> usize {
    2 * shortcut as usize + relu as usize
}

pub(super) fn lock<V>(m: &Mutex<V>) -> MutexGuard<'_, V> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Buffers made on first use: the unfused route's convolution output, the measurement's
/// output, the GEMM route's im2col columns.
#[derive(Default)]
pub(super) struct Buffers<T> {
    pub conv_out: Option<CudaSlice<T>>,
    pub probe: Option<CudaSlice<T>>,
    pub columns: Option<CudaSlice<T>>,
}

/// `conv → BatchNorm (inference, running statistics) → (+ shortcut) → ReLU` for one problem
/// and element type `T` (`f32`, `half::f16`, `half::bf16`), with the BatchNorm folded into the
/// convolution: `w'[k] = w[k]·γ[k]/sqrt(var[k]+eps)`, `b'[k] = β[k] − mean[k]·γ[k]/sqrt(var[k]+eps)`
/// (folded once, on the host in f64, by [`ConvBnInference::new`]), so that
/// `y = relu(conv(x, w') + b' + shortcut)` runs as one convolution with a fused epilogue.
///
/// Routes ([`BlockRoute`], eligibility in [`ConvBnInference::plan`]): one cuBLASLt matmul with
/// a bias/ReLU epilogue and the shortcut as C (NHWC; non-pointwise kernels through im2col), one
/// `cudnnConvolutionBiasActivationForward`, or the unfused composition (nnfuse's `Conv2d`, then
/// `BatchNorm` inference with ReLU / Add+ReLU). The first call of each (shortcut, ReLU)
/// combination runs the unfused composition into `y`, checks every eligible fused route
/// against it, times those that pass against it (GPU time, interleaved) and keeps the fastest
/// by the incumbent rule that convolution and GEMM use (the unfused one is the incumbent).
/// That call synchronises, allocates and copies to the host: make it outside CUDA graph
/// capture (it returns [`Error::Capture`] inside one). A decided fused route that fails at run
/// time falls back to the unfused composition for good, with a warning.
///
/// The parameters are copied at construction: later changes to the caller's buffers are not
/// seen (make a new object).
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use half::f16;
/// use nnfuse::block::{ConvBnInference, ConvBnParams};
/// use nnfuse::conv::ConvShape;
/// use nnfuse::TensorFormat;
/// let ctx = nnfuse::Context::new(0)?;
/// let shape = ConvShape {
///     n: 32, c_in: 64, h: 56, w: 56, c_out: 256, kh: 1, kw: 1,
///     stride: (1, 1), pad: (0, 0), dilation: (1, 1), format: TensorFormat::Nhwc,
/// };
/// let s = ctx.stream();
/// let w = s.clone_htod(&vec![f16::from_f32(0.01); shape.w_len()?])?;
/// let gamma = s.clone_htod(&vec![1.0f32; 256])?;
/// let beta = s.clone_htod(&vec![0.1f32; 256])?;
/// let mean = s.clone_htod(&vec![0.0f32; 256])?;
/// let var = s.clone_htod(&vec![1.0f32; 256])?;
/// let unit = ConvBnInference::<f16>::new(&ctx, &shape, ConvBnParams {
///     w: w.as_view(), gamma: gamma.as_view(), beta: beta.as_view(),
///     running_mean: mean.as_view(), running_var: var.as_view(), eps: 1e-5,
/// })?;
/// println!("{}", unit.plan());
/// let x = s.clone_htod(&vec![f16::from_f32(0.5); shape.x_len()?])?;
/// let shortcut = s.clone_htod(&vec![f16::from_f32(-0.25); shape.y_len()?])?;
/// let mut y = s.alloc_zeros::<f16>(shape.y_len()?)?;
/// unit.forward(&x.as_view(), Some(&shortcut.as_view()), true, &mut y.as_view_mut())?;
/// println!("{:?}", unit.choice(true, true));
/// # Ok(()) }
/// ```
pub struct ConvBnInference<T: Element> {
    pub(super) ctx: Context,
    pub(super) plan: BlockPlan,
    pub(super) conv: Conv2d<T>,
    /// BatchNorm inference of the unfused route, by [`Fuse`] (none, ReLU, Add+ReLU).
    pub(super) bn: [BatchNorm<T>; 3],
    pub(super) w: CudaSlice<T>,
    pub(super) gamma: CudaSlice<f32>,
    pub(super) beta: CudaSlice<f32>,
    pub(super) mean: CudaSlice<f32>,
    pub(super) var: CudaSlice<f32>,
    pub(super) eps: f64,
    pub(super) w_folded: CudaSlice<T>,
    pub(super) bias: CudaSlice<T>,
    /// Per ReLU flag: the GEMM route's descriptors and algorithm, or why there are none.
    pub(super) gemm: Mutex<[Made<EpilogueGemm>; 2]>,
    /// Per ReLU flag: the cuDNN route's descriptors, or why there are none.
    pub(super) cudnn: Mutex<[Made<CudnnFused>; 2]>,
    pub(super) buffers: Mutex<Buffers<T>>,
    pub(super) decisions: Mutex<[Option<BlockChoice>; 4]>,
    pub(super) _t: PhantomData<fn() -> T>,
}

impl<T: Element> std::fmt::Debug for ConvBnInference<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConvBnInference")
            .field("shape", &self.plan.shape)
            .field("dtype", &self.plan.dtype)
            .field("decisions", &*lock(&self.decisions))
            .finish()
    }
}

/// Checks one parameter's length, naming it.
fn check_len(name: &str, len: usize, want: usize, what: &str) -> Result<()> {
    if len != want {
        return Err(Error::invalid(
            name,
            format!("length {len}, expected {what} = {want}"),
        ));
    }
    Ok(())
}

/// The BatchNorm's `(shape, axis)` over the convolution's output.
fn bn_shape(s: &ConvShape) -> Result<(Vec<usize>, usize)> {
    let (oh, ow) = s.out_hw()?;
    Ok(match s.format {
        TensorFormat::Nhwc => (vec![s.n, oh, ow, s.c_out], 3),
        TensorFormat::Nchw => (vec![s.n, s.c_out, oh, ow], 1),
    })
}

impl<T: Element> ConvBnInference<T> {
    /// Plans `shape` for `T`, checks the parameters (lengths, naming the argument; `eps`;
    /// `running_var + eps > 0`), copies them and folds the BatchNorm into the filter and a bias
    /// (on the host in f64, once; rounded to `T`). Synchronises the stream (the parameters are
    /// read back): call it outside capture, once per problem and weights.
    pub fn new(ctx: &Context, shape: &ConvShape, p: ConvBnParams<'_, T>) -> Result<Self> {
        let plan = plan(shape, T::DTYPE, cudnn_present(), cublaslt_present())?;
        check_eps(p.eps)?;
        let k = shape.c_out;
        check_len("w", p.w.len(), shape.w_len()?, "c_out*c_in*kh*kw")?;
        for (name, v) in [
            ("gamma", &p.gamma),
            ("beta", &p.beta),
            ("running_mean", &p.running_mean),
            ("running_var", &p.running_var),
        ] {
            check_len(name, v.len(), k, "c_out")?;
        }
        ctx.refuse_under_capture("folding BatchNorm into a convolution", "read back")?;
        let s = ctx.stream();
        let host = |v: &CudaView<'_, f32>| -> Result<Vec<f64>> {
            Ok(s.clone_dtoh(v)
                .call("cuMemcpyDtoH")?
                .into_iter()
                .map(f64::from)
                .collect())
        };
        let (gamma, beta, mean, var) = (
            host(&p.gamma)?,
            host(&p.beta)?,
            host(&p.running_mean)?,
            host(&p.running_var)?,
        );
        let w: Vec<f64> = s
            .clone_dtoh(&p.w)
            .call("cuMemcpyDtoH")?
            .into_iter()
            .map(Element::to_f64)
            .collect();
        let folded = fold(
            shape,
            &w,
            &BnHost {
                gamma: &gamma,
                beta: &beta,
                running_mean: &mean,
                running_var: &var,
                eps: p.eps,
            },
        )?;
        let to_t = |v: &[f64]| v.iter().map(|&x| T::from_f64(x)).collect::<Vec<T>>();
        let (bshape, axis) = bn_shape(shape)?;
        let bn = [Fuse::None, Fuse::Relu, Fuse::AddRelu]
            .map(|f| BatchNorm::<T>::new(ctx, &bshape, axis, f));
        let [b0, b1, b2] = bn;
        let unit = ConvBnInference {
            ctx: ctx.clone(),
            conv: Conv2d::<T>::new(ctx, shape)?,
            bn: [b0?, b1?, b2?],
            w: s.clone_dtod(&p.w).call("cuMemcpyDtoDAsync")?,
            gamma: s.clone_dtod(&p.gamma).call("cuMemcpyDtoDAsync")?,
            beta: s.clone_dtod(&p.beta).call("cuMemcpyDtoDAsync")?,
            mean: s.clone_dtod(&p.running_mean).call("cuMemcpyDtoDAsync")?,
            var: s.clone_dtod(&p.running_var).call("cuMemcpyDtoDAsync")?,
            eps: p.eps,
            w_folded: s.clone_htod(&to_t(&folded.filter)).call("cuMemcpyHtoD")?,
            bias: s.clone_htod(&to_t(&folded.bias)).call("cuMemcpyHtoD")?,
            gemm: Mutex::new([None, None]),
            cudnn: Mutex::new([None, None]),
            buffers: Mutex::new(Buffers::default()),
            decisions: Mutex::new([None, None, None, None]),
            plan,
            _t: PhantomData,
        };
        tracing::info!(plan = %unit.plan, "conv+BN inference planned");
        Ok(unit)
    }

    /// Every route's eligibility and why.
    pub fn plan(&self) -> &BlockPlan {
        &self.plan
    }

    /// The problem.
    pub fn shape(&self) -> &ConvShape {
        &self.plan.shape
    }

    /// The decision for calls with (`shortcut`, `relu`), once the first such call made it.
    pub fn choice(&self, shortcut: bool, relu: bool) -> Option<BlockChoice> {
        lock(&self.decisions)[slot(shortcut, relu)].clone()
    }

    /// `y = [relu](conv(x, w') + b' [+ shortcut])`: validates every operand (lengths, device,
    /// `y` overlapping an input) before anything runs, then runs the decided route (deciding
    /// on the first call of this (shortcut, ReLU) combination; see the type's documentation).
    pub fn forward(
        &self,
        x: &CudaView<'_, T>,
        shortcut: Option<&CudaView<'_, T>>,
        relu: bool,
        y: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        self.validate(x, shortcut, y)?;
        let decided = lock(&self.decisions)[slot(shortcut.is_some(), relu)]
            .as_ref()
            .map(|c| c.route);
        let route = match decided {
            Some(r) => r,
            None => {
                return crate::cudnn_graph::replay::suspended(|| self.decide(x, shortcut, relu, y))
            }
        };
        // Misaligned operands cannot take the GEMM's algorithm: this call only runs unfused.
        if route == BlockRoute::Unfused
            || (route == BlockRoute::GemmEpilogue && !self.gemm_aligned(x, shortcut, y))
        {
            return self.run_unfused(x, shortcut, relu, y);
        }
        match self.run_fused(route, x, shortcut, relu, y) {
            Ok(()) => Ok(()),
            // Bad input and capture refusals are the caller's to see, not the route's failure.
            Err(e) if matches!(e, Error::InvalidArgument { .. } | Error::Capture { .. }) => Err(e),
            Err(e) => {
                self.fall_back(shortcut.is_some(), relu, route, &e);
                self.run_unfused(x, shortcut, relu, y)
            }
        }
    }

    /// [`ConvBnInference::forward`] on a given route (tests, benchmarks): no measurement, no
    /// fallback. A route the plan refuses is an [`Error::NotSupported`] carrying the plan's
    /// reason.
    pub fn forward_with(
        &self,
        route: BlockRoute,
        x: &CudaView<'_, T>,
        shortcut: Option<&CudaView<'_, T>>,
        relu: bool,
        y: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        let info = self.plan.info(route);
        if !info.eligible {
            return Err(Error::NotSupported(format!(
                "route {route} cannot run this problem: {}",
                info.reason
            )));
        }
        self.validate(x, shortcut, y)?;
        match route {
            BlockRoute::Unfused => self.run_unfused(x, shortcut, relu, y),
            r => self.run_fused(r, x, shortcut, relu, y),
        }
    }

    fn validate(
        &self,
        x: &CudaView<'_, T>,
        shortcut: Option<&CudaView<'_, T>>,
        y: &CudaViewMut<'_, T>,
    ) -> Result<()> {
        crate::profile::stage!(Call);
        let s = &self.plan.shape;
        let (x_len, y_len) = (s.x_len()?, s.y_len()?);
        let mut bind = Binder::new(&self.ctx);
        bind.input("x", x, Need::Exactly(x_len, "n*c_in*h*w"))?;
        if let Some(z) = shortcut {
            bind.input("shortcut", z, Need::Exactly(y_len, "n*c_out*oh*ow"))?;
        }
        bind.output_ref("y", y, Need::Exactly(y_len, "n*c_out*oh*ow"))?;
        bind.check(Aliasing::Distinct).map(|_| ())
    }

    /// Makes the unfused route the decision of (shortcut, relu) after `route` failed.
    fn fall_back(&self, shortcut: bool, relu: bool, route: BlockRoute, e: &Error) {
        tracing::warn!(%route, error = %e,
            "fused conv+BN inference route failed; the unfused composition takes over");
        let mut d = lock(&self.decisions);
        let slot = &mut d[slot(shortcut, relu)];
        let mut notes = slot.as_ref().map(|c| c.notes.clone()).unwrap_or_default();
        notes.push(format!(
            "{route} failed at run time ({e}); fell back to unfused"
        ));
        *slot = Some(BlockChoice {
            route: BlockRoute::Unfused,
            times_us: slot
                .as_ref()
                .map(|c| c.times_us.clone())
                .unwrap_or_default(),
            notes,
        });
    }
}
