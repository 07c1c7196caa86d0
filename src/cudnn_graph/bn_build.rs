//! Builders of one BatchNorm graph through cuDNN's backend API: the tensors of
//! [`super::bn_key`], the `NORM_FORWARD` (batch norm, training or inference phase) or
//! `NORM_BACKWARD` operation, the pointwise epilogue (`ADD`, `RELU_FWD`, the mask's `CMP_GT`;
//! `MUL` by the mask, or `RELU_BWD` from y, before the backward), the operation graph, and the
//! variant pack of one execution (any number of
//! tensors, by-value scalars included). Every attribute set is checked; no decisions here (the
//! engine choice lives in [`super::graph_bn`]).

use std::ffi::c_void;

use cudarc::cudnn::sys;

use crate::error::{Error, Result};

use super::bn_key::{BnDirection, BnElem, BnEpilogue, BnRole, BnTensorSpec, GraphBnKey, ReluGrad};
use super::build::{in_part, operation_graph, tensor_of, TensorAttrs};
use super::descriptor::{attr, Attr, DescKind, Descriptor, DevPtr};

/// A finalized tensor descriptor of `spec` (virtual for the epilogue's intermediates).
pub fn bn_tensor(spec: &BnTensorSpec) -> Result<Descriptor> {
    tensor_of(&TensorAttrs {
        uid: spec.uid,
        dims: spec.dims,
        strides: spec.strides,
        data_type: match spec.elem {
            BnElem::Data(d) => d.cudnn(),
            BnElem::Boolean => sys::cudnnDataType_t::CUDNN_DATA_BOOLEAN,
        },
        alignment: spec.alignment,
        is_virtual: spec.is_virtual,
        by_value: spec.by_value,
        part: spec.role.name(),
    })
}

/// The tensors of one graph: the key's roles in variant-pack order, then its virtual ones.
#[derive(Debug)]
pub struct BnTensors {
    roles: Vec<BnRole>,
    descs: Vec<Descriptor>,
}

impl BnTensors {
    /// Builds every tensor of `key`.
    pub fn build(key: &GraphBnKey) -> Result<BnTensors> {
        let roles: Vec<BnRole> = key.roles().iter().chain(key.virtuals()).copied().collect();
        let descs = roles
            .iter()
            .map(|&r| bn_tensor(&key.spec(r)))
            .collect::<Result<Vec<_>>>()?;
        Ok(BnTensors { roles, descs })
    }

    /// The descriptor of `role`.
    pub fn get(&self, role: BnRole) -> Result<&Descriptor> {
        self.roles
            .iter()
            .position(|&r| r == role)
            .map(|i| &self.descs[i])
            .ok_or_else(|| {
                Error::NotSupported(format!(
                    "internal: the BatchNorm graph has no {} tensor",
                    role.name()
                ))
            })
    }
}

/// Sets `attr` of `op` to the tensor of `role`.
fn link(op: &mut Descriptor, t: &BnTensors, attr: Attr, role: BnRole) -> Result<()> {
    op.set_descs(attr, &[t.get(role)?])
}

/// A finalized `NORM_FORWARD` batch norm of `phase` with its tensors `links` (attribute,
/// tensor); the role-based [`norm_forward`] and the fused-graph builder share it.
pub fn norm_forward_op(
    phase: sys::cudnnBackendNormFwdPhase_t,
    links: &[(Attr, &Descriptor)],
) -> Result<Descriptor> {
    let build = || -> Result<Descriptor> {
        let mut d = Descriptor::new(DescKind::NormForward)?;
        d.set_one(
            attr::CUDNN_ATTR_OPERATION_NORM_FWD_MODE,
            sys::cudnnBackendNormMode_t::CUDNN_BATCH_NORM,
        )?;
        d.set_one(attr::CUDNN_ATTR_OPERATION_NORM_FWD_PHASE, phase)?;
        for &(a, t) in links {
            d.set_descs(a, &[t])?;
        }
        d.finalize()?;
        Ok(d)
    };
    in_part(build(), "norm forward")
}

/// A finalized `NORM_BACKWARD` batch norm with its tensors `links` (attribute, tensor).
pub fn norm_backward_op(links: &[(Attr, &Descriptor)]) -> Result<Descriptor> {
    let build = || -> Result<Descriptor> {
        let mut d = Descriptor::new(DescKind::NormBackward)?;
        d.set_one(
            attr::CUDNN_ATTR_OPERATION_NORM_BWD_MODE,
            sys::cudnnBackendNormMode_t::CUDNN_BATCH_NORM,
        )?;
        for &(a, t) in links {
            d.set_descs(a, &[t])?;
        }
        d.finalize()?;
        Ok(d)
    };
    in_part(build(), "norm backward")
}

/// The `(attribute, tensor)` pairs of `roles`.
fn links<'t>(t: &'t BnTensors, roles: &[(Attr, BnRole)]) -> Result<Vec<(Attr, &'t Descriptor)>> {
    roles.iter().map(|&(a, r)| Ok((a, t.get(r)?))).collect()
}

/// The finalized `NORM_FORWARD` operation, batch norm, writing `out` (y, or the epilogue's
/// virtual input): the training phase (with the running statistics' update when the tensors
/// include it) or, with `inference`, the inference phase reading the running mean and an
/// inverse standard deviation.
pub fn norm_forward(t: &BnTensors, inference: bool, out: BnRole) -> Result<Descriptor> {
    use sys::cudnnBackendNormFwdPhase_t as P;
    use BnRole as R;
    if inference {
        let all = [
            (attr::CUDNN_ATTR_OPERATION_NORM_FWD_XDESC, R::X),
            (attr::CUDNN_ATTR_OPERATION_NORM_FWD_MEAN_DESC, R::Mean),
            (
                attr::CUDNN_ATTR_OPERATION_NORM_FWD_INV_VARIANCE_DESC,
                R::InvStd,
            ),
            (attr::CUDNN_ATTR_OPERATION_NORM_FWD_SCALE_DESC, R::Scale),
            (attr::CUDNN_ATTR_OPERATION_NORM_FWD_BIAS_DESC, R::Bias),
            (attr::CUDNN_ATTR_OPERATION_NORM_FWD_YDESC, out),
        ];
        return norm_forward_op(P::CUDNN_NORM_FWD_INFERENCE, &links(t, &all)?);
    }
    let mut all = vec![
        (attr::CUDNN_ATTR_OPERATION_NORM_FWD_XDESC, R::X),
        (attr::CUDNN_ATTR_OPERATION_NORM_FWD_MEAN_DESC, R::SavedMean),
        (
            attr::CUDNN_ATTR_OPERATION_NORM_FWD_INV_VARIANCE_DESC,
            R::SavedInvVar,
        ),
        (attr::CUDNN_ATTR_OPERATION_NORM_FWD_SCALE_DESC, R::Scale),
        (attr::CUDNN_ATTR_OPERATION_NORM_FWD_BIAS_DESC, R::Bias),
        (attr::CUDNN_ATTR_OPERATION_NORM_FWD_EPSILON_DESC, R::Epsilon),
        (attr::CUDNN_ATTR_OPERATION_NORM_FWD_YDESC, out),
    ];
    if t.roles.contains(&R::Momentum) {
        all.extend([
            (
                attr::CUDNN_ATTR_OPERATION_NORM_FWD_EXP_AVG_FACTOR_DESC,
                R::Momentum,
            ),
            (
                attr::CUDNN_ATTR_OPERATION_NORM_FWD_INPUT_RUNNING_MEAN_DESC,
                R::RunningMeanIn,
            ),
            (
                attr::CUDNN_ATTR_OPERATION_NORM_FWD_INPUT_RUNNING_VAR_DESC,
                R::RunningVarIn,
            ),
            (
                attr::CUDNN_ATTR_OPERATION_NORM_FWD_OUTPUT_RUNNING_MEAN_DESC,
                R::RunningMeanOut,
            ),
            (
                attr::CUDNN_ATTR_OPERATION_NORM_FWD_OUTPUT_RUNNING_VAR_DESC,
                R::RunningVarOut,
            ),
        ]);
    }
    norm_forward_op(P::CUDNN_NORM_FWD_TRAINING, &links(t, &all)?)
}

/// The finalized `NORM_BACKWARD` operation: batch norm, dx, dscale and dbias from `dy` (the
/// caller's dy, or the masked dy of a ReLU epilogue), x, the scale and the saved mean and
/// inverse standard deviation.
pub fn norm_backward(t: &BnTensors, dy: BnRole) -> Result<Descriptor> {
    use BnRole as R;
    let all = [
        (attr::CUDNN_ATTR_OPERATION_NORM_BWD_XDESC, R::X),
        (attr::CUDNN_ATTR_OPERATION_NORM_BWD_DYDESC, dy),
        (attr::CUDNN_ATTR_OPERATION_NORM_BWD_SCALE_DESC, R::Scale),
        (attr::CUDNN_ATTR_OPERATION_NORM_BWD_MEAN_DESC, R::SavedMean),
        (
            attr::CUDNN_ATTR_OPERATION_NORM_BWD_INV_VARIANCE_DESC,
            R::SavedInvVar,
        ),
        (attr::CUDNN_ATTR_OPERATION_NORM_BWD_DSCALE_DESC, R::Dscale),
        (attr::CUDNN_ATTR_OPERATION_NORM_BWD_DBIAS_DESC, R::Dbias),
        (attr::CUDNN_ATTR_OPERATION_NORM_BWD_DXDESC, R::Dx),
    ];
    norm_backward_op(&links(t, &all)?)
}

/// A finalized pointwise function of `mode`, computed in f32.
fn pointwise_fn(mode: sys::cudnnPointwiseMode_t) -> Result<Descriptor> {
    let mut d = Descriptor::new(DescKind::Pointwise)?;
    d.set_one(attr::CUDNN_ATTR_POINTWISE_MODE, mode)?;
    d.set_one(
        attr::CUDNN_ATTR_POINTWISE_MATH_PREC,
        crate::dtype::DType::F32.cudnn(),
    )?;
    d.finalize()?;
    Ok(d)
}

/// A finalized forward pointwise operation `y = mode(x[, b])` (`ADD`, `RELU_FWD`, `CMP_GT`,
/// `MUL`), with the function descriptor it refers to (kept alive together).
pub fn pointwise_fwd(
    t: &BnTensors,
    mode: sys::cudnnPointwiseMode_t,
    x: BnRole,
    b: Option<BnRole>,
    y: BnRole,
) -> Result<[Descriptor; 2]> {
    let build = || -> Result<[Descriptor; 2]> {
        let f = pointwise_fn(mode)?;
        let mut d = Descriptor::new(DescKind::OperationPointwise)?;
        d.set_descs(attr::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&f])?;
        link(&mut d, t, attr::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x)?;
        if let Some(b) = b {
            link(&mut d, t, attr::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b)?;
        }
        link(&mut d, t, attr::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y)?;
        d.finalize()?;
        Ok([d, f])
    };
    in_part(build(), "pointwise epilogue")
}

/// A finalized `RELU_BWD` operation: `dx = dy` where `x > 0`, else 0 (`x` is the forward's y:
/// positive exactly where the ReLU's input was).
pub fn relu_backward(t: &BnTensors, dy: BnRole, x: BnRole, dx: BnRole) -> Result<[Descriptor; 2]> {
    let build = || -> Result<[Descriptor; 2]> {
        let f = pointwise_fn(sys::cudnnPointwiseMode_t::CUDNN_POINTWISE_RELU_BWD)?;
        let mut d = Descriptor::new(DescKind::OperationPointwise)?;
        d.set_descs(attr::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&f])?;
        link(&mut d, t, attr::CUDNN_ATTR_OPERATION_POINTWISE_DYDESC, dy)?;
        link(&mut d, t, attr::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x)?;
        link(&mut d, t, attr::CUDNN_ATTR_OPERATION_POINTWISE_DXDESC, dx)?;
        d.finalize()?;
        Ok([d, f])
    };
    in_part(build(), "ReLU backward")
}

/// The operations of `key`'s graph, in data-flow order (each pointwise operation followed by
/// its function descriptor, which only needs to stay alive).
fn operations(key: &GraphBnKey, t: &BnTensors) -> Result<Vec<Descriptor>> {
    let mut ops = Vec::with_capacity(7);
    match key.direction {
        BnDirection::Backward => backward_operations(key, t, &mut ops)?,
        d => forward_operations(key, t, d == BnDirection::Inference, &mut ops)?,
    }
    Ok(ops)
}

/// The backward: the ReLU's gradient (`dy · mask`, or `RELU_BWD` from y) into the masked dy,
/// then `NORM_BACKWARD`.
fn backward_operations(key: &GraphBnKey, t: &BnTensors, ops: &mut Vec<Descriptor>) -> Result<()> {
    use BnEpilogue as E;
    use BnRole as R;
    let dy = match key.epilogue {
        E::None => R::Dy,
        E::Relu => R::DRelu,
        E::AddRelu => R::DAddend,
    };
    if dy != R::Dy {
        match key.relu_grad {
            ReluGrad::Mask => ops.extend(pointwise_fwd(
                t,
                sys::cudnnPointwiseMode_t::CUDNN_POINTWISE_MUL,
                R::Dy,
                Some(R::Mask),
                dy,
            )?),
            ReluGrad::FromY => ops.extend(relu_backward(t, R::Dy, R::Y, dy)?),
        }
    }
    ops.push(norm_backward(t, dy)?);
    Ok(())
}

/// The forward (training or inference): `NORM_FORWARD`, the epilogue (`ADD`, `RELU_FWD`), and
/// the training mask `CMP_GT(y, 0)` where the key keeps one.
fn forward_operations(
    key: &GraphBnKey,
    t: &BnTensors,
    inference: bool,
    ops: &mut Vec<Descriptor>,
) -> Result<()> {
    use sys::cudnnPointwiseMode_t as M;
    use BnEpilogue as E;
    use BnRole as R;
    let out = if key.epilogue == E::None {
        R::Y
    } else {
        R::BnOut
    };
    ops.push(norm_forward(t, inference, out)?);
    let relu_in = match key.epilogue {
        E::None => return Ok(()),
        E::Relu => R::BnOut,
        E::AddRelu => {
            ops.extend(pointwise_fwd(
                t,
                M::CUDNN_POINTWISE_ADD,
                R::BnOut,
                Some(R::Addend),
                R::AddOut,
            )?);
            R::AddOut
        }
    };
    ops.extend(pointwise_fwd(
        t,
        M::CUDNN_POINTWISE_RELU_FWD,
        relu_in,
        None,
        R::Y,
    )?);
    if key.has_mask() {
        ops.extend(pointwise_fwd(
            t,
            M::CUDNN_POINTWISE_CMP_GT,
            R::Y,
            Some(R::Zero),
            R::Mask,
        )?);
    }
    Ok(())
}

/// Every descriptor of one BatchNorm graph, kept alive together (the operation graph and the
/// plans made from it refer to them).
#[derive(Debug)]
pub struct BnGraphParts {
    /// The tensors (kept alive: the operations refer to them).
    _tensors: BnTensors,
    /// The operations and the pointwise functions (kept alive: the graph refers to them).
    _ops: Vec<Descriptor>,
    /// The finalized operation graph.
    pub graph: Descriptor,
}

impl BnGraphParts {
    /// Builds the graph of `key` on `handle`.
    pub fn build(handle: sys::cudnnHandle_t, key: &GraphBnKey) -> Result<BnGraphParts> {
        let tensors = BnTensors::build(key)?;
        let ops = operations(key, &tensors)?;
        let graph_ops: Vec<&Descriptor> = ops
            .iter()
            .filter(|d| d.kind() != DescKind::Pointwise)
            .collect();
        let graph = operation_graph(handle, &graph_ops)?;
        Ok(BnGraphParts {
            _tensors: tensors,
            _ops: ops,
            graph,
        })
    }
}

/// The variant pack of one BatchNorm execution: the key's unique ids, the data pointers in that
/// order (device addresses; host addresses of the by-value scalars) and the workspace. Built once
/// per set of pointers; a call with the same pointers reuses it.
#[derive(Debug)]
pub struct BnVariantPack {
    desc: Descriptor,
    ptrs: Vec<u64>,
    workspace: u64,
}

impl BnVariantPack {
    /// A finalized pack of `uids` and `ptrs` (same length and order) and `workspace` (0: none).
    pub fn new(uids: &[i64], ptrs: &[u64], workspace: u64) -> Result<BnVariantPack> {
        if uids.len() != ptrs.len() {
            return Err(Error::invalid(
                "ptrs",
                format!("{} pointers for {} unique ids", ptrs.len(), uids.len()),
            ));
        }
        let mut d = Descriptor::new(DescKind::VariantPack)?;
        d.set(attr::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, uids)?;
        let dev: Vec<DevPtr> = ptrs.iter().map(|&p| DevPtr(p as *mut c_void)).collect();
        d.set(attr::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, &dev)?;
        d.set_one(
            attr::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
            DevPtr(workspace as *mut c_void),
        )?;
        d.finalize()?;
        Ok(BnVariantPack {
            desc: d,
            ptrs: ptrs.to_vec(),
            workspace,
        })
    }

    /// Whether the pack holds exactly these pointers.
    pub fn matches(&self, ptrs: &[u64], workspace: u64) -> bool {
        self.ptrs == ptrs && self.workspace == workspace
    }

    /// The raw pack handle.
    pub fn raw(&self) -> sys::cudnnBackendDescriptor_t {
        self.desc.raw()
    }
}
