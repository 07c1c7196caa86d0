//! The runtime-fusion patterns of a fused training block (docs/BLOCK-TRAINING.md §2), each
//! as one [`FusionGraph`] built with [`FusionBuilder`]: which operations and tensors, named as
//! the variant pack takes them. Learned from cudnn-frontend's samples ("SBRCS", "BN Finalize
//! Graph", "scale-bias-relu-wgrad", "Dgrad Drelu DBNweight"): NHWC data, f32 intermediates, f32
//! math; per-channel statistics in f32.
//!
//! Also the BatchNorm epilogue graphs of `bn_build.rs` rebuilt with a choice of ReLU
//! attributes, to find out why they do not finalize, and the epilogue in cudnn-frontend's
//! mask form ("SGBN Add Relu" writing a `BOOLEAN` mask, "DBN Add Relu" reading it) with
//! named tensors, to run and check.

use cudarc::cudnn::sys;

use crate::conv::Direction;
use crate::dtype::DType;
use crate::error::Result;
use crate::reference::conv::Conv2d as ConvShape;

use super::bn_build::{norm_forward, BnTensors};
use super::bn_key::{BnEpilogue, BnRole, GraphBnKey};
use super::build::operation_graph;
use super::descriptor::Descriptor;
use super::fusion::{
    pointwise_op, BnBwdWeightsRefs, BnFinalizeRefs, ElemType, FusionBuilder, FusionGraph,
    FusionTensorSpec as T, NormBwdRefs, NormFwdRefs, ReluAttrs, TensorRef,
};

use sys::cudnnPointwiseMode_t as M;

/// The input prologue of a convolution: `relu(x · scale + bias)` with per-channel scale and
/// bias (the previous BatchNorm's apply), all virtual.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prologue {
    /// Element type of scale and bias (the samples use the I/O type; nnfuse's equivalent
    /// scale and bias are f32).
    pub affine: DType,
    /// How the ReLU is described.
    pub relu: ReluAttrs,
}

/// Adds `scale`, `bias` and the virtual `relu(x · scale + bias)` of `x` (dims `dims`), returning
/// the ReLU's output.
fn prologue(b: &mut FusionBuilder, x: TensorRef, dims: [i64; 4], p: Prologue) -> Result<TensorRef> {
    let scale = b.tensor(T::per_channel("scale", dims[1], p.affine))?;
    let bias = b.tensor(T::per_channel("bias", dims[1], p.affine))?;
    let scaled = b.tensor(T::intermediate("x_scaled", dims))?;
    let biased = b.tensor(T::intermediate("x_biased", dims))?;
    let relu = b.tensor(T::intermediate("x_relu", dims))?;
    b.pointwise(M::CUDNN_POINTWISE_MUL, x, Some(scale), scaled, p.relu)?;
    b.pointwise(M::CUDNN_POINTWISE_ADD, scaled, Some(bias), biased, p.relu)?;
    b.pointwise(M::CUDNN_POINTWISE_RELU_FWD, biased, None, relu, p.relu)?;
    Ok(relu)
}

/// ConvBNfprop ("SBRCS"): `[prologue →] conv_fprop(x, w) → y (real) → GEN_STATS → sum, sqsum`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvGenStats {
    /// The convolution (NHWC).
    pub shape: ConvShape,
    /// Element type of x, w, y.
    pub dtype: DType,
    /// The input prologue, or none (conv1 of a block).
    pub prologue: Option<Prologue>,
    /// `GEN_STATS`' math precision (the legacy sample: f32; cudnn-frontend's node: y's type).
    pub genstats_prec: DType,
}

impl ConvGenStats {
    /// The graph on `handle`; real tensors `x`, `w`, `y`, `sum`, `sqsum` (f32 `[1, k, 1, 1]`),
    /// and `scale`, `bias` with a prologue.
    pub fn build(&self, handle: sys::cudnnHandle_t) -> Result<FusionGraph> {
        let mut b = FusionBuilder::new();
        let [xs, ws, ys] = T::conv(&self.shape, self.dtype, ["x", "w", "y"])?;
        let x = b.tensor(xs)?;
        let conv_in = match self.prologue {
            Some(p) => prologue(&mut b, x, xs.dims, p)?,
            None => x,
        };
        let w = b.tensor(ws)?;
        let y = b.tensor(ys)?;
        let sum = b.tensor(T::per_channel("sum", ys.dims[1], DType::F32))?;
        let sqsum = b.tensor(T::per_channel("sqsum", ys.dims[1], DType::F32))?;
        b.convolution(Direction::Forward, &self.shape, [conv_in, w, y], false)?;
        b.genstats(y, sum, sqsum, self.genstats_prec)?;
        b.finish(handle)
    }
}

/// BN finalize: `BN_FINALIZE_STATISTICS` (training) of `c` channels. Real f32 `[1, c, 1, 1]`
/// tensors `sum`, `sqsum`, `scale`, `bias`, `prev_mean`, `prev_var`, `next_mean`, `next_var`,
/// `saved_mean`, `saved_inv_std`, `eq_scale`, `eq_bias`; by-value `epsilon` and `momentum` (of
/// `scalar`: f32 in cudnn-frontend's graph sample, double in the legacy sample) and
/// `accum_count` (int64).
pub fn bn_finalize(handle: sys::cudnnHandle_t, c: i64, scalar: ElemType) -> Result<FusionGraph> {
    let mut b = FusionBuilder::new();
    let mut v = |name| b.tensor(T::per_channel(name, c, DType::F32));
    let refs = BnFinalizeRefs {
        sum: v("sum")?,
        sqsum: v("sqsum")?,
        scale: v("scale")?,
        bias: v("bias")?,
        prev_mean: v("prev_mean")?,
        prev_var: v("prev_var")?,
        next_mean: v("next_mean")?,
        next_var: v("next_var")?,
        saved_mean: v("saved_mean")?,
        saved_inv_std: v("saved_inv_std")?,
        eq_scale: v("eq_scale")?,
        eq_bias: v("eq_bias")?,
        epsilon: b.tensor(T::scalar("epsilon", scalar))?,
        momentum: b.tensor(T::scalar("momentum", scalar))?,
        accum_count: b.tensor(T::scalar("accum_count", ElemType::Int64))?,
    };
    b.bn_finalize(&refs)?;
    b.finish(handle)
}

/// ConvBNwgrad ("scale-bias-relu-wgrad"): `dw = wgrad(dy, relu(x · scale + bias))`. Real
/// tensors `x`, `scale`, `bias`, `dy`, `dw`.
pub fn wgrad_prologue(
    handle: sys::cudnnHandle_t,
    shape: &ConvShape,
    dtype: DType,
    p: Prologue,
) -> Result<FusionGraph> {
    let mut b = FusionBuilder::new();
    let [xs, ws, ys] = T::conv(shape, dtype, ["x", "dw", "dy"])?;
    let x = b.tensor(xs)?;
    let relu = prologue(&mut b, x, xs.dims, p)?;
    let dw = b.tensor(ws)?;
    let dy = b.tensor(ys)?;
    b.convolution(Direction::BackwardFilter, shape, [relu, dw, dy], false)?;
    b.finish(handle)
}

/// DgradDreluBNBwdWeight: for the convolution `shape` that follows a BatchNorm + ReLU on its
/// input, `drelu = relu_bwd(dgrad(dy, w), (x − mean) · inv_std · scale + bias)` (real) and
/// `BN_BWD_WEIGHTS(drelu, x, mean, inv_std, scale)` → `dscale`, `dbias`, `eq_scale_dy`,
/// `eq_scale_x`, `eq_bias`. `x` is the BatchNorm's input (the convolution input's shape);
/// per-channel tensors are f32.
pub fn dgrad_drelu_dbn_weight(
    handle: sys::cudnnHandle_t,
    shape: &ConvShape,
    dtype: DType,
    relu: ReluAttrs,
) -> Result<FusionGraph> {
    let mut b = FusionBuilder::new();
    let [xs, ws, ys] = T::conv(shape, dtype, ["x", "w", "dy"])?;
    let dims = xs.dims;
    let dy = b.tensor(ys)?;
    let w = b.tensor(ws)?;
    let dgrad = b.tensor(T::intermediate("dgrad", dims))?;
    b.convolution(Direction::BackwardData, shape, [dgrad, w, dy], false)?;
    let x = b.tensor(xs)?;
    let c = dims[1];
    let mut v = |name| b.tensor(T::per_channel(name, c, DType::F32));
    let (mean, inv_std, scale, bias) = (v("mean")?, v("inv_std")?, v("scale")?, v("bias")?);
    let centered = b.tensor(T::intermediate("centered", dims))?;
    let normed = b.tensor(T::intermediate("normed", dims))?;
    let scaled = b.tensor(T::intermediate("scaled", dims))?;
    let bn_out = b.tensor(T::intermediate("bn_out", dims))?;
    b.pointwise(M::CUDNN_POINTWISE_SUB, x, Some(mean), centered, relu)?;
    b.pointwise(
        M::CUDNN_POINTWISE_MUL,
        centered,
        Some(inv_std),
        normed,
        relu,
    )?;
    b.pointwise(M::CUDNN_POINTWISE_MUL, normed, Some(scale), scaled, relu)?;
    b.pointwise(M::CUDNN_POINTWISE_ADD, scaled, Some(bias), bn_out, relu)?;
    let drelu = b.tensor(T::activation("drelu", dims, dtype))?;
    b.relu_backward(dgrad, bn_out, drelu, relu)?;
    let mut v = |name| b.tensor(T::per_channel(name, c, DType::F32));
    let refs = BnBwdWeightsRefs {
        x,
        dy: drelu,
        mean,
        inv_std,
        scale,
        dscale: v("dscale")?,
        dbias: v("dbias")?,
        eq_scale_dy: v("eq_scale_dy")?,
        eq_scale_x: v("eq_scale_x")?,
        eq_bias: v("eq_bias")?,
    };
    b.bn_bwd_weights(&refs)?;
    b.finish(handle)
}

/// The data gradient accumulated into its output (`beta = 1`): `dx += dgrad(dy, w)`. Real
/// tensors `dx`, `w`, `dy`.
pub fn dgrad_accumulate(
    handle: sys::cudnnHandle_t,
    shape: &ConvShape,
    dtype: DType,
) -> Result<FusionGraph> {
    let mut b = FusionBuilder::new();
    let [xs, ws, ys] = T::conv(shape, dtype, ["dx", "w", "dy"])?;
    let dx = b.tensor(xs)?;
    let w = b.tensor(ws)?;
    let dy = b.tensor(ys)?;
    b.convolution(Direction::BackwardData, shape, [dx, w, dy], true)?;
    b.finish(handle)
}

/// A BatchNorm forward graph with a ReLU / Add+ReLU epilogue as `bn_build.rs` builds it,
/// except for the ReLU's attributes (`relu`); for probing only (no variant pack).
#[derive(Debug)]
pub struct BnEpilogueGraph {
    _tensors: BnTensors,
    _ops: Vec<Descriptor>,
    /// The finalized operation graph.
    pub graph: Descriptor,
}

/// The training (or, with `inference`, inference) forward of `key` with its epilogue, the ReLU
/// described by `relu`.
pub fn bn_epilogue(
    handle: sys::cudnnHandle_t,
    key: &GraphBnKey,
    inference: bool,
    relu: ReluAttrs,
) -> Result<BnEpilogueGraph> {
    let t = BnTensors::build(key)?;
    let mut ops = Vec::with_capacity(5);
    let out = if key.epilogue == BnEpilogue::None {
        BnRole::Y
    } else {
        BnRole::BnOut
    };
    ops.push(norm_forward(&t, inference, out)?);
    let relu_in = match key.epilogue {
        BnEpilogue::None => None,
        BnEpilogue::Relu => Some(BnRole::BnOut),
        BnEpilogue::AddRelu => {
            let g = |r| t.get(r);
            ops.extend(pointwise_op(
                M::CUDNN_POINTWISE_ADD,
                g(BnRole::BnOut)?,
                Some(g(BnRole::Addend)?),
                g(BnRole::AddOut)?,
                relu,
            )?);
            Some(BnRole::AddOut)
        }
    };
    if let Some(r) = relu_in {
        ops.extend(pointwise_op(
            M::CUDNN_POINTWISE_RELU_FWD,
            t.get(r)?,
            None,
            t.get(BnRole::Y)?,
            relu,
        )?);
    }
    // The mask form's training forward also writes the mask, as `bn_build.rs` builds it.
    if key.has_mask() && !inference {
        ops.extend(pointwise_op(
            M::CUDNN_POINTWISE_CMP_GT,
            t.get(BnRole::Y)?,
            Some(t.get(BnRole::Zero)?),
            t.get(BnRole::Mask)?,
            relu,
        )?);
    }
    let graph_ops: Vec<&Descriptor> = ops
        .iter()
        .filter(|d| d.kind() != super::descriptor::DescKind::Pointwise)
        .collect();
    let graph = operation_graph(handle, &graph_ops)?;
    Ok(BnEpilogueGraph {
        _tensors: t,
        _ops: ops,
        graph,
    })
}

/// Which value the ReLU mask of [`BnMaskForward`] compares with zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskSource {
    /// The real output y (cudnn-frontend's `test_bn_relu_with_mask`; what nnfuse builds).
    Y,
    /// The virtual pre-ReLU value (the normalised output, plus the addend).
    PreRelu,
}

/// What the mask's `CMP_GT` compares with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskComparand {
    /// A by-value f32 zero, `zero` (the LayerNorm bitmask sample; what nnfuse builds).
    ScalarZero,
    /// A real tensor of zeros shaped and typed like x, `zeros` (cudnn-frontend's
    /// `test_bn_relu_with_mask`).
    ZerosTensor,
}

/// The training forward "SGBN Add Relu" with the ReLU mask: `NORM_FORWARD` (running statistics
/// updated) → (`ADD` addend) → `RELU_FWD` → y, and `CMP_GT(source, comparand)` → `mask`
/// (`BOOLEAN`, real). Real tensors `x`, `scale`, `bias`, `prev_mean`, `prev_var`, `next_mean`,
/// `next_var`, `saved_mean`, `saved_inv_var` (f32 per channel), `y`, `mask`, `addend` with
/// `add`, `zeros` (or the by-value `zero`); by-value f32 `epsilon` and `momentum`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BnMaskForward {
    /// `[n, c, h, w]`, NHWC.
    pub dims: [i64; 4],
    /// Element type of x, y, addend.
    pub dtype: DType,
    /// Add+ReLU (else ReLU).
    pub add: bool,
    /// What the mask compares.
    pub source: MaskSource,
    /// What it compares with.
    pub comparand: MaskComparand,
}

impl BnMaskForward {
    /// The graph on `handle`.
    pub fn build(&self, handle: sys::cudnnHandle_t) -> Result<FusionGraph> {
        let (dims, c) = (self.dims, self.dims[1]);
        let mut b = FusionBuilder::new();
        let x = b.tensor(T::activation("x", dims, self.dtype))?;
        let mut v = |name| b.tensor(T::per_channel(name, c, DType::F32));
        let (scale, bias) = (v("scale")?, v("bias")?);
        let (prev_mean, prev_var) = (v("prev_mean")?, v("prev_var")?);
        let (next_mean, next_var) = (v("next_mean")?, v("next_var")?);
        let (saved_mean, saved_inv_var) = (v("saved_mean")?, v("saved_inv_var")?);
        let f32s = ElemType::Data(DType::F32);
        let epsilon = b.tensor(T::scalar("epsilon", f32s))?;
        let momentum = b.tensor(T::scalar("momentum", f32s))?;
        let bn_out = b.tensor(T::intermediate("bn_out", dims))?;
        b.norm_forward_training(&NormFwdRefs {
            x,
            scale,
            bias,
            epsilon,
            momentum,
            prev_mean,
            prev_var,
            next_mean,
            next_var,
            saved_mean,
            saved_inv_var,
            y: bn_out,
        })?;
        let relu = ReluAttrs::Bare;
        let pre = if self.add {
            let addend = b.tensor(T::activation("addend", dims, self.dtype))?;
            let sum = b.tensor(T::intermediate("add_out", dims))?;
            b.pointwise(M::CUDNN_POINTWISE_ADD, bn_out, Some(addend), sum, relu)?;
            sum
        } else {
            bn_out
        };
        let y = b.tensor(T::activation("y", dims, self.dtype))?;
        b.pointwise(M::CUDNN_POINTWISE_RELU_FWD, pre, None, y, relu)?;
        let cmp = match self.comparand {
            MaskComparand::ScalarZero => b.tensor(T::scalar("zero", f32s))?,
            MaskComparand::ZerosTensor => b.tensor(T::activation("zeros", dims, self.dtype))?,
        };
        let mask = b.tensor(T::mask("mask", dims))?;
        let source = match self.source {
            MaskSource::Y => y,
            MaskSource::PreRelu => pre,
        };
        b.pointwise(M::CUDNN_POINTWISE_CMP_GT, source, Some(cmp), mask, relu)?;
        b.finish(handle)
    }
}

/// The backward "DBN Add Relu": `dy · mask` (`MUL` by the `BOOLEAN` mask) → `NORM_BACKWARD`
/// with the saved statistics → `dx`, `dscale`, `dbias`; with `add` the masked dy is the real
/// `d_addend` (the add's gradient, "DADD"), else virtual. Real tensors `dy`, `mask`, `x`, `dx`
/// (and `d_addend`) of the data type, `scale`, `mean`, `inv_var`, `dscale`, `dbias` f32 per
/// channel.
pub fn bn_mask_backward(
    handle: sys::cudnnHandle_t,
    dims: [i64; 4],
    dtype: DType,
    add: bool,
) -> Result<FusionGraph> {
    let c = dims[1];
    let mut b = FusionBuilder::new();
    let dy = b.tensor(T::activation("dy", dims, dtype))?;
    let mask = b.tensor(T::mask("mask", dims))?;
    let masked = if add {
        b.tensor(T::activation("d_addend", dims, dtype))?
    } else {
        b.tensor(T::intermediate("drelu", dims))?
    };
    b.pointwise(
        M::CUDNN_POINTWISE_MUL,
        dy,
        Some(mask),
        masked,
        ReluAttrs::Bare,
    )?;
    let x = b.tensor(T::activation("x", dims, dtype))?;
    let dx = b.tensor(T::activation("dx", dims, dtype))?;
    let mut v = |name| b.tensor(T::per_channel(name, c, DType::F32));
    let refs = NormBwdRefs {
        x,
        dy: masked,
        scale: v("scale")?,
        mean: v("mean")?,
        inv_var: v("inv_var")?,
        dscale: v("dscale")?,
        dbias: v("dbias")?,
        dx,
    };
    b.norm_backward(&refs)?;
    b.finish(handle)
}
