//! A general fused operation graph through cuDNN's backend API: named tensors (real, virtual or
//! by-value, of any element type cuDNN takes, int64 and double scalars included), pointwise
//! operations, convolutions, `GEN_STATS`, `BN_FINALIZE_STATISTICS`, `BN_BWD_WEIGHTS` and the
//! `NORM_FORWARD` / `NORM_BACKWARD` batch norms in one
//! graph; the search over its engine configs that records every finalize status; and the
//! variant pack of the named real tensors. Each attribute set is checked (errors name it).
//!
//! The patterns themselves (which operations, which tensors) live in
//! `fusion_patterns.rs`; this file knows no pattern. Tensor specs are pure and tested on
//! the CPU; everything else calls cuDNN (no device work before an execution).

use std::time::Instant;

use cudarc::cudnn::sys;

use crate::conv::Direction;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::TensorFormat;
use crate::reference::conv::Conv2d as ConvShape;

use super::build::{self, in_part, ExecutionPlan};
use super::descriptor::{attr, check, Attr, DescKind, Descriptor};
use super::layout::{packed_strides, tensor_specs, MAX_ALIGNMENT};
use super::notes::{EngineInfo, HeurSource};

/// The element type of a fused graph's tensor: a data type nnfuse stores, or one of the scalar
/// types cuDNN's statistics operations take by value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElemType {
    /// f32, f16 or bf16.
    Data(DType),
    /// `CUDNN_DATA_INT64` (BN finalize's accumulation count).
    Int64,
    /// `CUDNN_DATA_DOUBLE` (the legacy samples' BN finalize epsilon and momentum).
    Double,
    /// `CUDNN_DATA_BOOLEAN` (a ReLU mask written by `CMP_GT`).
    Boolean,
}

impl ElemType {
    /// cuDNN's data type.
    pub fn cudnn(self) -> sys::cudnnDataType_t {
        match self {
            ElemType::Data(d) => d.cudnn(),
            ElemType::Int64 => sys::cudnnDataType_t::CUDNN_DATA_INT64,
            ElemType::Double => sys::cudnnDataType_t::CUDNN_DATA_DOUBLE,
            ElemType::Boolean => sys::cudnnDataType_t::CUDNN_DATA_BOOLEAN,
        }
    }
}

/// Everything one tensor descriptor of a fused graph is built from (its unique id is given by
/// the builder).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FusionTensorSpec {
    /// The name the variant pack and errors use (`x`, `sum`, `eq_scale`, ...).
    pub name: &'static str,
    /// Logical dimensions `[n, c, h, w]` (filters `[k, c, r, s]`).
    pub dims: [i64; 4],
    /// Element strides of `dims`.
    pub strides: [i64; 4],
    /// Element type.
    pub elem: ElemType,
    /// An intermediate that never reaches memory.
    pub is_virtual: bool,
    /// A scalar the variant pack passes by host address.
    pub by_value: bool,
}

impl FusionTensorSpec {
    /// A real NHWC activation `[n, c, h, w]` of `dtype`.
    pub fn activation(name: &'static str, dims: [i64; 4], dtype: DType) -> FusionTensorSpec {
        FusionTensorSpec {
            name,
            dims,
            strides: packed_strides(TensorFormat::Nhwc, dims),
            elem: ElemType::Data(dtype),
            is_virtual: false,
            by_value: false,
        }
    }

    /// A virtual NHWC intermediate `[n, c, h, w]` in f32 (cudnn-frontend's intermediate type).
    pub fn intermediate(name: &'static str, dims: [i64; 4]) -> FusionTensorSpec {
        FusionTensorSpec {
            is_virtual: true,
            ..FusionTensorSpec::activation(name, dims, DType::F32)
        }
    }

    /// A real NHWC `BOOLEAN` tensor `[n, c, h, w]` (a ReLU mask).
    pub fn mask(name: &'static str, dims: [i64; 4]) -> FusionTensorSpec {
        FusionTensorSpec {
            elem: ElemType::Boolean,
            ..FusionTensorSpec::activation(name, dims, DType::F32)
        }
    }

    /// A real per-channel vector `[1, c, 1, 1]` of `dtype`.
    pub fn per_channel(name: &'static str, c: i64, dtype: DType) -> FusionTensorSpec {
        FusionTensorSpec::activation(name, [1, c, 1, 1], dtype)
    }

    /// A by-value scalar `[1, 1, 1, 1]` of `elem`.
    pub fn scalar(name: &'static str, elem: ElemType) -> FusionTensorSpec {
        FusionTensorSpec {
            name,
            dims: [1; 4],
            strides: [1; 4],
            elem,
            is_virtual: false,
            by_value: true,
        }
    }

    /// The x, w and y specs of a convolution `shape` (NHWC data, KRSC filter) for `dtype`,
    /// named `names`; validates the shape.
    pub fn conv(
        shape: &ConvShape,
        dtype: DType,
        names: [&'static str; 3],
    ) -> Result<[FusionTensorSpec; 3]> {
        if shape.format != TensorFormat::Nhwc {
            return Err(Error::invalid(
                "format",
                "the fused graphs are built for NHWC data only",
            ));
        }
        let specs = tensor_specs(shape, dtype, MAX_ALIGNMENT)?;
        let mut i = 0;
        Ok(specs.map(|s| {
            let name = names[i];
            i += 1;
            FusionTensorSpec {
                name,
                dims: s.dims,
                strides: s.strides,
                elem: ElemType::Data(dtype),
                is_virtual: false,
                by_value: false,
            }
        }))
    }

    /// The same tensor made virtual (and f32, the intermediate type).
    pub fn into_virtual(self) -> FusionTensorSpec {
        FusionTensorSpec {
            is_virtual: true,
            elem: ElemType::Data(DType::F32),
            ..self
        }
    }
}

/// The first unique id a builder gives; ids then count up in the order tensors are added.
pub const FIRST_UID: i64 = 100;

/// A finalized tensor descriptor of `spec` with unique id `uid`.
fn tensor_desc(spec: &FusionTensorSpec, uid: i64) -> Result<Descriptor> {
    let build = || -> Result<Descriptor> {
        let mut d = Descriptor::new(DescKind::Tensor)?;
        d.set_one(attr::CUDNN_ATTR_TENSOR_DATA_TYPE, spec.elem.cudnn())?;
        d.set(attr::CUDNN_ATTR_TENSOR_DIMENSIONS, &spec.dims)?;
        d.set(attr::CUDNN_ATTR_TENSOR_STRIDES, &spec.strides)?;
        d.set_one(attr::CUDNN_ATTR_TENSOR_UNIQUE_ID, uid)?;
        d.set_one(
            attr::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT,
            i64::from(MAX_ALIGNMENT),
        )?;
        d.set_one(attr::CUDNN_ATTR_TENSOR_IS_VIRTUAL, spec.is_virtual)?;
        if spec.by_value {
            d.set_one(attr::CUDNN_ATTR_TENSOR_IS_BY_VALUE, true)?;
        }
        d.finalize()?;
        Ok(d)
    };
    in_part(build(), spec.name)
}

/// How a ReLU's pointwise descriptor is described.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReluAttrs {
    /// Mode and math precision only (as nnfuse's BatchNorm epilogues set it).
    Bare,
    /// Also NaN propagation, lower clip 0, upper clip f32::MAX and lower-clip slope 0, as
    /// cudnn-frontend's pointwise node sets for `RELU_FWD` / `RELU_BWD`.
    Frontend,
}

impl ReluAttrs {
    /// `bare` or `frontend`.
    pub fn name(self) -> &'static str {
        match self {
            ReluAttrs::Bare => "bare",
            ReluAttrs::Frontend => "frontend",
        }
    }
}

/// A finalized pointwise function of `mode` in f32, with `relu`'s attributes for the ReLU modes.
fn pointwise_fn(mode: sys::cudnnPointwiseMode_t, relu: ReluAttrs) -> Result<Descriptor> {
    use sys::cudnnPointwiseMode_t as M;
    let mut d = Descriptor::new(DescKind::Pointwise)?;
    d.set_one(attr::CUDNN_ATTR_POINTWISE_MODE, mode)?;
    d.set_one(attr::CUDNN_ATTR_POINTWISE_MATH_PREC, DType::F32.cudnn())?;
    let is_relu = matches!(
        mode,
        M::CUDNN_POINTWISE_RELU_FWD | M::CUDNN_POINTWISE_RELU_BWD
    );
    if is_relu && relu == ReluAttrs::Frontend {
        d.set_one(
            attr::CUDNN_ATTR_POINTWISE_NAN_PROPAGATION,
            sys::cudnnNanPropagation_t::CUDNN_PROPAGATE_NAN,
        )?;
        d.set_one(attr::CUDNN_ATTR_POINTWISE_RELU_LOWER_CLIP, 0.0f64)?;
        d.set_one(
            attr::CUDNN_ATTR_POINTWISE_RELU_UPPER_CLIP,
            f64::from(f32::MAX),
        )?;
        d.set_one(attr::CUDNN_ATTR_POINTWISE_RELU_LOWER_CLIP_SLOPE, 0.0f64)?;
    }
    d.finalize()?;
    Ok(d)
}

/// A finalized forward pointwise operation `y = mode(x[, b])` and its function descriptor
/// (kept alive together).
pub fn pointwise_op(
    mode: sys::cudnnPointwiseMode_t,
    x: &Descriptor,
    b: Option<&Descriptor>,
    y: &Descriptor,
    relu: ReluAttrs,
) -> Result<[Descriptor; 2]> {
    let build = || -> Result<[Descriptor; 2]> {
        let f = pointwise_fn(mode, relu)?;
        let mut d = Descriptor::new(DescKind::OperationPointwise)?;
        d.set_descs(attr::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&f])?;
        d.set_descs(attr::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, &[x])?;
        if let Some(b) = b {
            d.set_descs(attr::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &[b])?;
        }
        d.set_descs(attr::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &[y])?;
        d.finalize()?;
        Ok([d, f])
    };
    in_part(build(), "pointwise")
}

/// A finalized `RELU_BWD` operation (`dx = dy` where `x > 0`, else 0) and its function
/// descriptor.
pub fn relu_backward_op(
    dy: &Descriptor,
    x: &Descriptor,
    dx: &Descriptor,
    relu: ReluAttrs,
) -> Result<[Descriptor; 2]> {
    let build = || -> Result<[Descriptor; 2]> {
        let f = pointwise_fn(sys::cudnnPointwiseMode_t::CUDNN_POINTWISE_RELU_BWD, relu)?;
        let mut d = Descriptor::new(DescKind::OperationPointwise)?;
        d.set_descs(attr::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&f])?;
        d.set_descs(attr::CUDNN_ATTR_OPERATION_POINTWISE_DYDESC, &[dy])?;
        d.set_descs(attr::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, &[x])?;
        d.set_descs(attr::CUDNN_ATTR_OPERATION_POINTWISE_DXDESC, &[dx])?;
        d.finalize()?;
        Ok([d, f])
    };
    in_part(build(), "ReLU backward")
}

/// A handle to one tensor added to a [`FusionBuilder`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorRef(usize);

/// Builds one fused operation graph: tensors first, then operations in data-flow order.
#[derive(Debug, Default)]
pub struct FusionBuilder {
    specs: Vec<FusionTensorSpec>,
    tensors: Vec<Descriptor>,
    /// Operations, in the order they were added.
    ops: Vec<Descriptor>,
    /// Descriptors the operations refer to (pointwise functions, convolution parameters).
    keep: Vec<Descriptor>,
}

impl FusionBuilder {
    /// An empty graph.
    pub fn new() -> FusionBuilder {
        FusionBuilder::default()
    }

    /// Adds the tensor `spec` (unique id [`FIRST_UID`] + its position). Names are unique.
    pub fn tensor(&mut self, spec: FusionTensorSpec) -> Result<TensorRef> {
        if self.specs.iter().any(|s| s.name == spec.name) {
            return Err(Error::invalid(
                "name",
                format!("the graph already has a tensor {}", spec.name),
            ));
        }
        let uid = FIRST_UID + self.specs.len() as i64;
        self.tensors.push(tensor_desc(&spec, uid)?);
        self.specs.push(spec);
        Ok(TensorRef(self.specs.len() - 1))
    }

    fn desc(&self, t: TensorRef) -> &Descriptor {
        &self.tensors[t.0]
    }

    fn link(&self, op: &mut Descriptor, a: Attr, t: TensorRef) -> Result<()> {
        op.set_descs(a, &[self.desc(t)])
    }

    /// `y = mode(x[, b])` (`ADD`, `SUB`, `MUL` with a per-channel `b`; `RELU_FWD` without).
    pub fn pointwise(
        &mut self,
        mode: sys::cudnnPointwiseMode_t,
        x: TensorRef,
        b: Option<TensorRef>,
        y: TensorRef,
        relu: ReluAttrs,
    ) -> Result<()> {
        let b = b.map(|b| self.desc(b));
        let [op, f] = pointwise_op(mode, self.desc(x), b, self.desc(y), relu)?;
        self.ops.push(op);
        self.keep.push(f);
        Ok(())
    }

    /// `dx = dy` where `x > 0`, else 0 (`RELU_BWD`).
    pub fn relu_backward(
        &mut self,
        dy: TensorRef,
        x: TensorRef,
        dx: TensorRef,
        relu: ReluAttrs,
    ) -> Result<()> {
        let [op, f] = relu_backward_op(self.desc(dy), self.desc(x), self.desc(dx), relu)?;
        self.ops.push(op);
        self.keep.push(f);
        Ok(())
    }

    /// A convolution of `shape` in `direction` over `[x, w, y]` (dx, dw, dy for the
    /// gradients), `beta` 1 with `accumulate`.
    pub fn convolution(
        &mut self,
        direction: Direction,
        shape: &ConvShape,
        [x, w, y]: [TensorRef; 3],
        accumulate: bool,
    ) -> Result<()> {
        let conv = build::convolution(shape)?;
        let op = build::operation(
            direction,
            &conv,
            [self.desc(x), self.desc(w), self.desc(y)],
            accumulate,
        )?;
        self.ops.push(op);
        self.keep.push(conv);
        Ok(())
    }

    /// `GEN_STATS` (`SUM_SQSUM`): per-channel sum and sum of squares of `x`, computed in `prec`.
    pub fn genstats(
        &mut self,
        x: TensorRef,
        sum: TensorRef,
        sqsum: TensorRef,
        prec: DType,
    ) -> Result<()> {
        let build = || -> Result<Descriptor> {
            let mut d = Descriptor::new(DescKind::GenStats)?;
            d.set_one(
                attr::CUDNN_ATTR_OPERATION_GENSTATS_MODE,
                sys::cudnnGenStatsMode_t::CUDNN_GENSTATS_SUM_SQSUM,
            )?;
            d.set_one(attr::CUDNN_ATTR_OPERATION_GENSTATS_MATH_PREC, prec.cudnn())?;
            self.link(&mut d, attr::CUDNN_ATTR_OPERATION_GENSTATS_XDESC, x)?;
            self.link(&mut d, attr::CUDNN_ATTR_OPERATION_GENSTATS_SUMDESC, sum)?;
            self.link(&mut d, attr::CUDNN_ATTR_OPERATION_GENSTATS_SQSUMDESC, sqsum)?;
            d.finalize()?;
            Ok(d)
        };
        let op = in_part(build(), "gen stats")?;
        self.ops.push(op);
        Ok(())
    }

    /// `BN_FINALIZE_STATISTICS` (training mode, f32 math) over `t`.
    pub fn bn_finalize(&mut self, t: &BnFinalizeRefs) -> Result<()> {
        use attr as a;
        let links = [
            (a::CUDNN_ATTR_OPERATION_BN_FINALIZE_Y_SUM_DESC, t.sum),
            (a::CUDNN_ATTR_OPERATION_BN_FINALIZE_Y_SQ_SUM_DESC, t.sqsum),
            (a::CUDNN_ATTR_OPERATION_BN_FINALIZE_SCALE_DESC, t.scale),
            (a::CUDNN_ATTR_OPERATION_BN_FINALIZE_BIAS_DESC, t.bias),
            (
                a::CUDNN_ATTR_OPERATION_BN_FINALIZE_PREV_RUNNING_MEAN_DESC,
                t.prev_mean,
            ),
            (
                a::CUDNN_ATTR_OPERATION_BN_FINALIZE_PREV_RUNNING_VAR_DESC,
                t.prev_var,
            ),
            (
                a::CUDNN_ATTR_OPERATION_BN_FINALIZE_UPDATED_RUNNING_MEAN_DESC,
                t.next_mean,
            ),
            (
                a::CUDNN_ATTR_OPERATION_BN_FINALIZE_UPDATED_RUNNING_VAR_DESC,
                t.next_var,
            ),
            (
                a::CUDNN_ATTR_OPERATION_BN_FINALIZE_SAVED_MEAN_DESC,
                t.saved_mean,
            ),
            (
                a::CUDNN_ATTR_OPERATION_BN_FINALIZE_SAVED_INV_STD_DESC,
                t.saved_inv_std,
            ),
            (
                a::CUDNN_ATTR_OPERATION_BN_FINALIZE_EQ_SCALE_DESC,
                t.eq_scale,
            ),
            (a::CUDNN_ATTR_OPERATION_BN_FINALIZE_EQ_BIAS_DESC, t.eq_bias),
            (
                a::CUDNN_ATTR_OPERATION_BN_FINALIZE_ACCUM_COUNT_DESC,
                t.accum_count,
            ),
            (a::CUDNN_ATTR_OPERATION_BN_FINALIZE_EPSILON_DESC, t.epsilon),
            (
                a::CUDNN_ATTR_OPERATION_BN_FINALIZE_EXP_AVERATE_FACTOR_DESC,
                t.momentum,
            ),
        ];
        let build = || -> Result<Descriptor> {
            let mut d = Descriptor::new(DescKind::BnFinalize)?;
            d.set_one(
                a::CUDNN_ATTR_OPERATION_BN_FINALIZE_STATS_MODE,
                sys::cudnnBnFinalizeStatsMode_t::CUDNN_BN_FINALIZE_STATISTICS_TRAINING,
            )?;
            d.set_one(
                a::CUDNN_ATTR_OPERATION_BN_FINALIZE_MATH_PREC,
                DType::F32.cudnn(),
            )?;
            for (at, r) in links {
                self.link(&mut d, at, r)?;
            }
            d.finalize()?;
            Ok(d)
        };
        let op = in_part(build(), "BN finalize")?;
        self.ops.push(op);
        Ok(())
    }

    /// `BN_BWD_WEIGHTS` (f32 math) over `t`.
    pub fn bn_bwd_weights(&mut self, t: &BnBwdWeightsRefs) -> Result<()> {
        use attr as a;
        let links = [
            (a::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_X_DESC, t.x),
            (a::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_DY_DESC, t.dy),
            (a::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_MEAN_DESC, t.mean),
            (
                a::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_INVSTD_DESC,
                t.inv_std,
            ),
            (
                a::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_BN_SCALE_DESC,
                t.scale,
            ),
            (
                a::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_DBN_SCALE_DESC,
                t.dscale,
            ),
            (
                a::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_DBN_BIAS_DESC,
                t.dbias,
            ),
            (
                a::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_EQ_DY_SCALE_DESC,
                t.eq_scale_dy,
            ),
            (
                a::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_EQ_X_SCALE_DESC,
                t.eq_scale_x,
            ),
            (a::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_EQ_BIAS, t.eq_bias),
        ];
        let build = || -> Result<Descriptor> {
            let mut d = Descriptor::new(DescKind::BnBwdWeights)?;
            d.set_one(
                a::CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_MATH_PREC,
                DType::F32.cudnn(),
            )?;
            for (at, r) in links {
                self.link(&mut d, at, r)?;
            }
            d.finalize()?;
            Ok(d)
        };
        let op = in_part(build(), "BN backward weights")?;
        self.ops.push(op);
        Ok(())
    }

    /// `NORM_FORWARD` batch norm, training phase, with the running statistics' update, over
    /// `t` (built by `bn_build.rs`).
    pub fn norm_forward_training(&mut self, t: &NormFwdRefs) -> Result<()> {
        use attr as a;
        let links = [
            (a::CUDNN_ATTR_OPERATION_NORM_FWD_XDESC, t.x),
            (a::CUDNN_ATTR_OPERATION_NORM_FWD_MEAN_DESC, t.saved_mean),
            (
                a::CUDNN_ATTR_OPERATION_NORM_FWD_INV_VARIANCE_DESC,
                t.saved_inv_var,
            ),
            (a::CUDNN_ATTR_OPERATION_NORM_FWD_SCALE_DESC, t.scale),
            (a::CUDNN_ATTR_OPERATION_NORM_FWD_BIAS_DESC, t.bias),
            (a::CUDNN_ATTR_OPERATION_NORM_FWD_EPSILON_DESC, t.epsilon),
            (a::CUDNN_ATTR_OPERATION_NORM_FWD_YDESC, t.y),
            (
                a::CUDNN_ATTR_OPERATION_NORM_FWD_EXP_AVG_FACTOR_DESC,
                t.momentum,
            ),
            (
                a::CUDNN_ATTR_OPERATION_NORM_FWD_INPUT_RUNNING_MEAN_DESC,
                t.prev_mean,
            ),
            (
                a::CUDNN_ATTR_OPERATION_NORM_FWD_INPUT_RUNNING_VAR_DESC,
                t.prev_var,
            ),
            (
                a::CUDNN_ATTR_OPERATION_NORM_FWD_OUTPUT_RUNNING_MEAN_DESC,
                t.next_mean,
            ),
            (
                a::CUDNN_ATTR_OPERATION_NORM_FWD_OUTPUT_RUNNING_VAR_DESC,
                t.next_var,
            ),
        ];
        let links: Vec<(Attr, &Descriptor)> =
            links.iter().map(|&(at, r)| (at, self.desc(r))).collect();
        let op = super::bn_build::norm_forward_op(
            sys::cudnnBackendNormFwdPhase_t::CUDNN_NORM_FWD_TRAINING,
            &links,
        )?;
        self.ops.push(op);
        Ok(())
    }

    /// `NORM_BACKWARD` batch norm over `t` (built by `bn_build.rs`).
    pub fn norm_backward(&mut self, t: &NormBwdRefs) -> Result<()> {
        use attr as a;
        let links = [
            (a::CUDNN_ATTR_OPERATION_NORM_BWD_XDESC, t.x),
            (a::CUDNN_ATTR_OPERATION_NORM_BWD_DYDESC, t.dy),
            (a::CUDNN_ATTR_OPERATION_NORM_BWD_SCALE_DESC, t.scale),
            (a::CUDNN_ATTR_OPERATION_NORM_BWD_MEAN_DESC, t.mean),
            (
                a::CUDNN_ATTR_OPERATION_NORM_BWD_INV_VARIANCE_DESC,
                t.inv_var,
            ),
            (a::CUDNN_ATTR_OPERATION_NORM_BWD_DSCALE_DESC, t.dscale),
            (a::CUDNN_ATTR_OPERATION_NORM_BWD_DBIAS_DESC, t.dbias),
            (a::CUDNN_ATTR_OPERATION_NORM_BWD_DXDESC, t.dx),
        ];
        let links: Vec<(Attr, &Descriptor)> =
            links.iter().map(|&(at, r)| (at, self.desc(r))).collect();
        let op = super::bn_build::norm_backward_op(&links)?;
        self.ops.push(op);
        Ok(())
    }

    /// Adds an operation built elsewhere (e.g. a `NORM_FORWARD` of `bn_build.rs`) with
    /// the descriptors it refers to, which must stay alive with the graph.
    pub fn push_op(&mut self, op: Descriptor, keep: Vec<Descriptor>) {
        self.ops.push(op);
        self.keep.extend(keep);
    }

    /// The finalized operation graph on `handle`.
    pub fn finish(self, handle: sys::cudnnHandle_t) -> Result<FusionGraph> {
        if self.ops.is_empty() {
            return Err(Error::invalid("ops", "a fused graph needs an operation"));
        }
        let refs: Vec<&Descriptor> = self.ops.iter().collect();
        let graph = build::operation_graph(handle, &refs)?;
        Ok(FusionGraph {
            specs: self.specs,
            _tensors: self.tensors,
            _ops: self.ops,
            _keep: self.keep,
            graph,
        })
    }
}

/// The tensors of a `BN_FINALIZE_STATISTICS` operation.
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct BnFinalizeRefs {
    pub sum: TensorRef,
    pub sqsum: TensorRef,
    pub scale: TensorRef,
    pub bias: TensorRef,
    pub prev_mean: TensorRef,
    pub prev_var: TensorRef,
    pub next_mean: TensorRef,
    pub next_var: TensorRef,
    pub saved_mean: TensorRef,
    pub saved_inv_std: TensorRef,
    pub eq_scale: TensorRef,
    pub eq_bias: TensorRef,
    pub accum_count: TensorRef,
    pub epsilon: TensorRef,
    pub momentum: TensorRef,
}

/// The tensors of a training `NORM_FORWARD` with the running statistics' update.
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct NormFwdRefs {
    pub x: TensorRef,
    pub scale: TensorRef,
    pub bias: TensorRef,
    pub epsilon: TensorRef,
    pub momentum: TensorRef,
    pub prev_mean: TensorRef,
    pub prev_var: TensorRef,
    pub next_mean: TensorRef,
    pub next_var: TensorRef,
    pub saved_mean: TensorRef,
    pub saved_inv_var: TensorRef,
    pub y: TensorRef,
}

/// The tensors of a `NORM_BACKWARD` operation.
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct NormBwdRefs {
    pub x: TensorRef,
    pub dy: TensorRef,
    pub scale: TensorRef,
    pub mean: TensorRef,
    pub inv_var: TensorRef,
    pub dscale: TensorRef,
    pub dbias: TensorRef,
    pub dx: TensorRef,
}

/// The tensors of a `BN_BWD_WEIGHTS` operation.
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct BnBwdWeightsRefs {
    pub x: TensorRef,
    pub dy: TensorRef,
    pub mean: TensorRef,
    pub inv_std: TensorRef,
    pub scale: TensorRef,
    pub dscale: TensorRef,
    pub dbias: TensorRef,
    pub eq_scale_dy: TensorRef,
    pub eq_scale_x: TensorRef,
    pub eq_bias: TensorRef,
}

/// A finalized fused operation graph with every descriptor it refers to.
#[derive(Debug)]
pub struct FusionGraph {
    specs: Vec<FusionTensorSpec>,
    _tensors: Vec<Descriptor>,
    _ops: Vec<Descriptor>,
    _keep: Vec<Descriptor>,
    /// The finalized operation graph.
    pub graph: Descriptor,
}

impl FusionGraph {
    /// The real (non-virtual) tensors in variant-pack order: unique id and spec.
    pub fn pack_tensors(&self) -> Vec<(i64, FusionTensorSpec)> {
        self.specs
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_virtual)
            .map(|(i, s)| (FIRST_UID + i as i64, *s))
            .collect()
    }

    /// The variant pack's unique ids and pointers for `addr(name)` of every real tensor (device
    /// addresses; host addresses of by-value scalars). Names a tensor without an address.
    pub fn pack_of(&self, addr: impl Fn(&str) -> Option<u64>) -> Result<(Vec<i64>, Vec<u64>)> {
        let mut uids = Vec::new();
        let mut ptrs = Vec::new();
        for (uid, s) in self.pack_tensors() {
            let p = addr(s.name).ok_or_else(|| Error::invalid(s.name, "no address given"))?;
            uids.push(uid);
            ptrs.push(p);
        }
        Ok((uids, ptrs))
    }
}

/// One engine config's attempt to become an execution plan.
#[derive(Debug)]
pub struct PlanAttempt {
    /// The engine, its knobs and notes.
    pub info: EngineInfo,
    /// The workspace bytes, or the failed call, its status and cuDNN's message.
    pub outcome: std::result::Result<usize, String>,
    /// How long the plan's finalize took (runtime-compiled engines compile here).
    pub finalize_ms: f64,
}

/// What the heuristics listed for a graph and how each listed config's finalize went.
#[derive(Debug)]
pub struct PlanSearch {
    /// Configs listed by mode INSTANT, or its error.
    pub instant: std::result::Result<usize, String>,
    /// Configs listed by mode FALLBACK, or its error.
    pub fallback: std::result::Result<usize, String>,
    /// Distinct configs (INSTANT then FALLBACK, duplicates dropped).
    pub listed: usize,
    /// Each config tried, in order.
    pub attempts: Vec<PlanAttempt>,
    /// The first plan that finalized, with its engine.
    pub plan: Option<(EngineInfo, ExecutionPlan)>,
}

impl PlanSearch {
    /// How many attempts finalized.
    pub fn finalized(&self) -> usize {
        self.attempts.iter().filter(|a| a.outcome.is_ok()).count()
    }
}

/// The failed call's message: cuDNN's own (`cudnnGetLastErrorString`) where it gave one.
fn failure(e: &Error) -> String {
    match build::last_message() {
        m if m.is_empty() => e.to_string(),
        m => format!("{e} ({m})"),
    }
}

/// Lists `graph`'s engine configs (INSTANT, then FALLBACK) and finalizes them in order until
/// `max_plans` have finalized (each plan's finalize may compile an engine: seconds), recording
/// every status. No engine policy is applied: this is what cuDNN offers.
pub fn search_plans(
    handle: sys::cudnnHandle_t,
    graph: &Descriptor,
    max_plans: usize,
) -> PlanSearch {
    let mut all = Vec::new();
    let mut count = |mode| match build::heuristics(graph, mode) {
        Ok(list) => {
            let n = list.len();
            all.extend(list);
            Ok(n)
        }
        Err(e) => Err(failure(&e)),
    };
    let instant = count(HeurSource::Instant);
    let fallback = count(HeurSource::Fallback);
    let configs = super::notes::dedup(all, |c: &build::EngineConfig| &c.info);
    let mut search = PlanSearch {
        instant,
        fallback,
        listed: configs.len(),
        attempts: Vec::new(),
        plan: None,
    };
    for cfg in configs {
        if search.finalized() >= max_plans {
            break;
        }
        let start = Instant::now();
        let result = ExecutionPlan::new(handle, &cfg.desc);
        let finalize_ms = start.elapsed().as_secs_f64() * 1e3;
        let outcome = match &result {
            Ok(p) => Ok(p.workspace()),
            Err(e) => Err(failure(e)),
        };
        if let (Ok(plan), None) = (result, &search.plan) {
            search.plan = Some((cfg.info.clone(), plan));
        }
        search.attempts.push(PlanAttempt {
            info: cfg.info,
            outcome,
            finalize_ms,
        });
    }
    search
}

/// A finalized variant pack of `uids` and `ptrs` with `workspace` (0: none).
pub fn variant_pack(
    uids: &[i64],
    ptrs: &[u64],
    workspace: u64,
) -> Result<super::bn_build::BnVariantPack> {
    super::bn_build::BnVariantPack::new(uids, ptrs, workspace)
}

/// `cudnnBackendExecute(handle, plan, pack)` of a fused graph.
///
/// # Safety
/// `handle` is the plan's, bound to the stream of every buffer and used by no other thread
/// meanwhile; the pack's device pointers hold the graph's tensors (16-byte aligned) and the
/// workspace, outputs disjoint from inputs, valid until the queued work completes; its host
/// pointers (by-value scalars) are valid for the call.
pub unsafe fn execute(
    handle: sys::cudnnHandle_t,
    plan: &ExecutionPlan,
    pack: &super::bn_build::BnVariantPack,
) -> Result<()> {
    check(
        sys::cudnnBackendExecute(handle, plan.raw(), pack.raw()),
        "cudnnBackendExecute(fused graph)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activation_specs_are_nhwc_and_per_channel_vectors_packed() {
        let a = FusionTensorSpec::activation("x", [2, 64, 8, 8], DType::F16);
        assert_eq!(a.strides, [8 * 8 * 64, 1, 8 * 64, 64]);
        assert!(!a.is_virtual && !a.by_value);
        let v = FusionTensorSpec::intermediate("t", [2, 64, 8, 8]);
        assert!(v.is_virtual);
        assert_eq!(v.elem, ElemType::Data(DType::F32));
        let c = FusionTensorSpec::per_channel("sum", 64, DType::F32);
        assert_eq!((c.dims, c.strides), ([1, 64, 1, 1], [64, 1, 64, 64]));
        let s = FusionTensorSpec::scalar("accum_count", ElemType::Int64);
        assert!(s.by_value && !s.is_virtual);
        assert_eq!(s.elem.cudnn(), sys::cudnnDataType_t::CUDNN_DATA_INT64);
        assert_eq!(
            ElemType::Double.cudnn(),
            sys::cudnnDataType_t::CUDNN_DATA_DOUBLE
        );
        let m = FusionTensorSpec::mask("mask", [2, 64, 8, 8]);
        assert_eq!((m.elem, m.strides), (ElemType::Boolean, a.strides));
        assert!(!m.is_virtual && !m.by_value);
        assert_eq!(
            ElemType::Boolean.cudnn(),
            sys::cudnnDataType_t::CUDNN_DATA_BOOLEAN
        );
    }

    #[test]
    fn conv_specs_follow_the_shape_and_refuse_nchw() {
        let s = ConvShape::square(2, 64, 8, 256, 1, TensorFormat::Nhwc);
        let [x, w, y] = FusionTensorSpec::conv(&s, DType::BF16, ["x", "w", "y"]).unwrap();
        assert_eq!(x.dims, [2, 64, 8, 8]);
        assert_eq!(w.dims, [256, 64, 1, 1]);
        assert_eq!(y.dims, [2, 256, 8, 8]);
        assert_eq!(y.strides, [8 * 8 * 256, 1, 8 * 256, 256]);
        assert_eq!(w.name, "w");
        let v = y.into_virtual();
        assert!(v.is_virtual && v.elem == ElemType::Data(DType::F32));
        let nchw = ConvShape::square(2, 64, 8, 256, 1, TensorFormat::Nchw);
        let e = FusionTensorSpec::conv(&nchw, DType::F16, ["x", "w", "y"]).unwrap_err();
        assert_eq!(e.argument(), Some("format"), "{e}");
    }
}
