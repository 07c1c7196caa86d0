//! Thin wrappers of the cuDNN BatchNorm entry points: raw device pointers in, `Result` naming
//! the call out. No decisions here — the dispatcher decides, these only call.
//!
//! Every function is `unsafe`: the caller guarantees that pointers address buffers of the sizes
//! the descriptors describe, on the device of the handle, valid until the stream has run the
//! call.

use std::ffi::c_void;
use std::ptr::null_mut;

use cudarc::cudnn::sys as cudnn;
use cudarc::driver::sys::CUdeviceptr;

use crate::batchnorm::descriptor::{cudnn_mode, ReluDesc, TensorDesc};
use crate::batchnorm::types::BnMode;
use crate::cudnn_graph::replay_rule::{ReplayKey, MAX_REPLAY_PTRS};
use crate::error::{cudnn_check, Result};

/// cuDNN's fused operation selector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ops {
    Bn,
    BnRelu,
    BnAddRelu,
}

impl Ops {
    fn cudnn(self) -> cudnn::cudnnBatchNormOps_t {
        use cudnn::cudnnBatchNormOps_t as O;
        match self {
            Ops::Bn => O::CUDNN_BATCHNORM_OPS_BN,
            Ops::BnRelu => O::CUDNN_BATCHNORM_OPS_BN_ACTIVATION,
            Ops::BnAddRelu => O::CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION,
        }
    }
}

static ONE: f32 = 1.0;
static ZERO: f32 = 0.0;

fn one() -> *const c_void {
    &ONE as *const f32 as *const c_void
}
fn zero() -> *const c_void {
    &ZERO as *const f32 as *const c_void
}
fn p(ptr: CUdeviceptr) -> *mut c_void {
    ptr as *mut c_void
}
fn act(relu: Option<&ReluDesc>) -> cudnn::cudnnActivationDescriptor_t {
    relu.map_or(null_mut(), |r| r.0)
}

/// Sizes the Ex API asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct ExSizes {
    pub(crate) forward_workspace: usize,
    pub(crate) backward_workspace: usize,
    pub(crate) reserve: usize,
}

/// Queries the Ex workspace and reserve sizes for `ops`. (Not a support test: cuDNN answers
/// some unsupported combinations here and refuses them only in the forward — docs/CUDNN-FACTS.md.)
pub(crate) unsafe fn ex_sizes(
    h: cudnn::cudnnHandle_t,
    mode: BnMode,
    ops: Ops,
    x: &TensorDesc,
    param: &TensorDesc,
    relu: Option<&ReluDesc>,
) -> Result<ExSizes> {
    let mut s = ExSizes::default();
    let z = if ops == Ops::BnAddRelu {
        x.0
    } else {
        null_mut()
    };
    cudnn_check(
        cudnn::cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(
            h,
            cudnn_mode(mode),
            ops.cudnn(),
            x.0,
            z,
            x.0,
            param.0,
            act(relu),
            &mut s.forward_workspace,
        ),
        "cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize",
    )?;
    let y = if ops == Ops::Bn { null_mut() } else { x.0 };
    cudnn_check(
        cudnn::cudnnGetBatchNormalizationBackwardExWorkspaceSize(
            h,
            cudnn_mode(mode),
            ops.cudnn(),
            x.0,
            y,
            x.0,
            z,
            x.0,
            param.0,
            act(relu),
            &mut s.backward_workspace,
        ),
        "cudnnGetBatchNormalizationBackwardExWorkspaceSize",
    )?;
    cudnn_check(
        cudnn::cudnnGetBatchNormalizationTrainingExReserveSpaceSize(
            h,
            cudnn_mode(mode),
            ops.cudnn(),
            act(relu),
            x.0,
            &mut s.reserve,
        ),
        "cudnnGetBatchNormalizationTrainingExReserveSpaceSize",
    )?;
    Ok(s)
}

/// Pointers of one training forward.
pub(crate) struct FwdPtrs {
    pub(crate) x: CUdeviceptr,
    /// The addend (BN+Add+ReLU only), else 0.
    pub(crate) z: CUdeviceptr,
    pub(crate) y: CUdeviceptr,
    pub(crate) gamma: CUdeviceptr,
    pub(crate) beta: CUdeviceptr,
    pub(crate) running_mean: CUdeviceptr,
    pub(crate) running_var: CUdeviceptr,
    pub(crate) saved_mean: CUdeviceptr,
    pub(crate) saved_inv_var: CUdeviceptr,
}

/// Which legacy BatchNorm call a replay key is of (with the BatchNorm's fixed descriptors, mode
/// and activation, it names the call).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call {
    /// `cudnnBatchNormalizationForwardTrainingEx` with these ops.
    ForwardEx(Ops),
    /// `cudnnBatchNormalizationForwardTraining`.
    Forward,
    /// `cudnnBatchNormalizationBackwardEx` with these ops.
    BackwardEx(Ops),
    /// `cudnnBatchNormalizationBackward`.
    Backward,
}

impl Call {
    fn tag(self) -> u64 {
        let ops = |o: Ops| o as u64;
        match self {
            Call::ForwardEx(o) => 1 + ops(o),
            Call::Forward => 8,
            Call::BackwardEx(o) => 16 + ops(o),
            Call::Backward => 24,
        }
    }

    /// The replay key of this call on `operands`: the call, the workspace and reserve
    /// (address, bytes) and the by-value `scalars` appended.
    fn key(
        self,
        operands: &[u64],
        ws: (u64, usize),
        reserve: (u64, usize),
        scalars: [f64; 2],
    ) -> Option<ReplayKey> {
        let tail = [self.tag(), ws.1 as u64, reserve.0, reserve.1 as u64];
        let n = operands.len() + tail.len();
        let mut all = [0u64; MAX_REPLAY_PTRS];
        all.get_mut(..operands.len())?.copy_from_slice(operands);
        all.get_mut(operands.len()..n)?.copy_from_slice(&tail);
        ReplayKey::new(&all[..n], ws.0, scalars)
    }
}

impl FwdPtrs {
    /// The replay key of `call` on these pointers (`cudnn_graph/replay_rule.rs`): workspace and
    /// reserve (address, bytes), momentum and epsilon.
    pub(crate) fn replay_key(
        &self,
        call: Call,
        ws: (u64, usize),
        reserve: (u64, usize),
        momentum: f64,
        eps: f64,
    ) -> Option<ReplayKey> {
        let operands = [
            self.x,
            self.z,
            self.y,
            self.gamma,
            self.beta,
            self.running_mean,
            self.running_var,
            self.saved_mean,
            self.saved_inv_var,
        ];
        call.key(&operands, ws, reserve, [momentum, eps])
    }
}

/// `cudnnBatchNormalizationForwardTrainingEx`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn forward_training_ex(
    h: cudnn::cudnnHandle_t,
    mode: BnMode,
    ops: Ops,
    x: &TensorDesc,
    param: &TensorDesc,
    relu: Option<&ReluDesc>,
    ptrs: &FwdPtrs,
    momentum: f64,
    eps: f64,
    workspace: (CUdeviceptr, usize),
    reserve: (CUdeviceptr, usize),
) -> Result<()> {
    let (z_desc, z) = if ops == Ops::BnAddRelu {
        (x.0, p(ptrs.z))
    } else {
        (null_mut(), null_mut())
    };
    cudnn_check(
        cudnn::cudnnBatchNormalizationForwardTrainingEx(
            h,
            cudnn_mode(mode),
            ops.cudnn(),
            one(),
            zero(),
            x.0,
            p(ptrs.x),
            z_desc,
            z,
            x.0,
            p(ptrs.y),
            param.0,
            p(ptrs.gamma),
            p(ptrs.beta),
            momentum,
            p(ptrs.running_mean),
            p(ptrs.running_var),
            eps,
            p(ptrs.saved_mean),
            p(ptrs.saved_inv_var),
            act(relu),
            p(workspace.0),
            workspace.1,
            p(reserve.0),
            reserve.1,
        ),
        "cudnnBatchNormalizationForwardTrainingEx",
    )
}

/// `cudnnBatchNormalizationForwardTraining` (legacy API; no activation).
pub(crate) unsafe fn forward_training(
    h: cudnn::cudnnHandle_t,
    mode: BnMode,
    x: &TensorDesc,
    param: &TensorDesc,
    ptrs: &FwdPtrs,
    momentum: f64,
    eps: f64,
) -> Result<()> {
    cudnn_check(
        cudnn::cudnnBatchNormalizationForwardTraining(
            h,
            cudnn_mode(mode),
            one(),
            zero(),
            x.0,
            p(ptrs.x),
            x.0,
            p(ptrs.y),
            param.0,
            p(ptrs.gamma),
            p(ptrs.beta),
            momentum,
            p(ptrs.running_mean),
            p(ptrs.running_var),
            eps,
            p(ptrs.saved_mean),
            p(ptrs.saved_inv_var),
        ),
        "cudnnBatchNormalizationForwardTraining",
    )
}

/// Pointers of one backward.
pub(crate) struct BwdPtrs {
    pub(crate) x: CUdeviceptr,
    /// The forward's y (fused ops only), else 0.
    pub(crate) y: CUdeviceptr,
    pub(crate) dy: CUdeviceptr,
    /// The addend's gradient (BN+Add+ReLU only), else 0.
    pub(crate) dz: CUdeviceptr,
    pub(crate) dx: CUdeviceptr,
    pub(crate) gamma: CUdeviceptr,
    pub(crate) beta: CUdeviceptr,
    pub(crate) dgamma: CUdeviceptr,
    pub(crate) dbeta: CUdeviceptr,
    pub(crate) saved_mean: CUdeviceptr,
    pub(crate) saved_inv_var: CUdeviceptr,
}

impl BwdPtrs {
    /// The replay key of `call` on these pointers: workspace and reserve (address, bytes) and
    /// the forward's epsilon.
    pub(crate) fn replay_key(
        &self,
        call: Call,
        ws: (u64, usize),
        reserve: (u64, usize),
        eps: f64,
    ) -> Option<ReplayKey> {
        let operands = [
            self.x,
            self.y,
            self.dy,
            self.dz,
            self.dx,
            self.gamma,
            self.beta,
            self.dgamma,
            self.dbeta,
            self.saved_mean,
            self.saved_inv_var,
        ];
        call.key(&operands, ws, reserve, [eps, 0.0])
    }
}

/// `cudnnBatchNormalizationBackwardEx`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn backward_ex(
    h: cudnn::cudnnHandle_t,
    mode: BnMode,
    ops: Ops,
    x: &TensorDesc,
    param: &TensorDesc,
    relu: Option<&ReluDesc>,
    ptrs: &BwdPtrs,
    eps: f64,
    workspace: (CUdeviceptr, usize),
    reserve: (CUdeviceptr, usize),
) -> Result<()> {
    let (y_desc, y) = if ops == Ops::Bn {
        (null_mut(), null_mut())
    } else {
        (x.0, p(ptrs.y))
    };
    let (dz_desc, dz) = if ops == Ops::BnAddRelu {
        (x.0, p(ptrs.dz))
    } else {
        (null_mut(), null_mut())
    };
    cudnn_check(
        cudnn::cudnnBatchNormalizationBackwardEx(
            h,
            cudnn_mode(mode),
            ops.cudnn(),
            one(),
            zero(),
            one(),
            zero(),
            x.0,
            p(ptrs.x),
            y_desc,
            y,
            x.0,
            p(ptrs.dy),
            dz_desc,
            dz,
            x.0,
            p(ptrs.dx),
            param.0,
            p(ptrs.gamma),
            p(ptrs.beta),
            p(ptrs.dgamma),
            p(ptrs.dbeta),
            eps,
            p(ptrs.saved_mean),
            p(ptrs.saved_inv_var),
            act(relu),
            p(workspace.0),
            workspace.1,
            p(reserve.0),
            reserve.1,
        ),
        "cudnnBatchNormalizationBackwardEx",
    )
}

/// `cudnnBatchNormalizationBackward` (legacy API; no activation).
pub(crate) unsafe fn backward(
    h: cudnn::cudnnHandle_t,
    mode: BnMode,
    x: &TensorDesc,
    param: &TensorDesc,
    ptrs: &BwdPtrs,
    eps: f64,
) -> Result<()> {
    cudnn_check(
        cudnn::cudnnBatchNormalizationBackward(
            h,
            cudnn_mode(mode),
            one(),
            zero(),
            one(),
            zero(),
            x.0,
            p(ptrs.x),
            x.0,
            p(ptrs.dy),
            x.0,
            p(ptrs.dx),
            param.0,
            p(ptrs.gamma),
            p(ptrs.dgamma),
            p(ptrs.dbeta),
            eps,
            p(ptrs.saved_mean),
            p(ptrs.saved_inv_var),
        ),
        "cudnnBatchNormalizationBackward",
    )
}

/// `cudnnBatchNormalizationForwardInference`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn forward_inference(
    h: cudnn::cudnnHandle_t,
    mode: BnMode,
    x_desc: &TensorDesc,
    param: &TensorDesc,
    x: CUdeviceptr,
    y: CUdeviceptr,
    gamma: CUdeviceptr,
    beta: CUdeviceptr,
    mean: CUdeviceptr,
    var: CUdeviceptr,
    eps: f64,
) -> Result<()> {
    cudnn_check(
        cudnn::cudnnBatchNormalizationForwardInference(
            h,
            cudnn_mode(mode),
            one(),
            zero(),
            x_desc.0,
            p(x),
            x_desc.0,
            p(y),
            param.0,
            p(gamma),
            p(beta),
            p(mean),
            p(var),
            eps,
        ),
        "cudnnBatchNormalizationForwardInference",
    )
}
