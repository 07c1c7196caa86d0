//! Builders of one BatchNorm graph through cuDNN's backend API: the tensors of
//! [`super::bn_key`], the `NORM_FORWARD` (batch norm, training phase) or `NORM_BACKWARD`
//! operation, the operation graph, and the variant pack of one execution (any number of
//! tensors, by-value scalars included). Every attribute set is checked; no decisions here (the
//! engine choice lives in [`super::graph_bn`]).

use std::ffi::c_void;

use cudarc::cudnn::sys;

use crate::error::{Error, Result};

use super::bn_key::{BnDirection, BnRole, BnTensorSpec, GraphBnKey};
use super::build::{in_part, operation_graph, tensor_of, TensorAttrs};
use super::descriptor::{attr, Attr, DescKind, Descriptor, DevPtr};

/// A finalized tensor descriptor of `spec` (never virtual: a BatchNorm graph has no
/// intermediates).
pub fn bn_tensor(spec: &BnTensorSpec) -> Result<Descriptor> {
    tensor_of(&TensorAttrs {
        uid: spec.uid,
        dims: spec.dims,
        strides: spec.strides,
        dtype: spec.dtype,
        alignment: spec.alignment,
        is_virtual: false,
        by_value: spec.by_value,
        part: spec.role.name(),
    })
}

/// The tensors of one graph, in the key's role order.
#[derive(Debug)]
pub struct BnTensors {
    roles: &'static [BnRole],
    descs: Vec<Descriptor>,
}

impl BnTensors {
    /// Builds every tensor of `key`.
    pub fn build(key: &GraphBnKey) -> Result<BnTensors> {
        let roles = key.roles();
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

/// The finalized `NORM_FORWARD` operation: batch norm, training phase, with the running
/// statistics' update when the tensors include it.
pub fn norm_forward(t: &BnTensors) -> Result<Descriptor> {
    let build = || -> Result<Descriptor> {
        let mut d = Descriptor::new(DescKind::NormForward)?;
        d.set_one(
            attr::CUDNN_ATTR_OPERATION_NORM_FWD_MODE,
            sys::cudnnBackendNormMode_t::CUDNN_BATCH_NORM,
        )?;
        d.set_one(
            attr::CUDNN_ATTR_OPERATION_NORM_FWD_PHASE,
            sys::cudnnBackendNormFwdPhase_t::CUDNN_NORM_FWD_TRAINING,
        )?;
        use BnRole as R;
        let always = [
            (attr::CUDNN_ATTR_OPERATION_NORM_FWD_XDESC, R::X),
            (attr::CUDNN_ATTR_OPERATION_NORM_FWD_MEAN_DESC, R::SavedMean),
            (
                attr::CUDNN_ATTR_OPERATION_NORM_FWD_INV_VARIANCE_DESC,
                R::SavedInvVar,
            ),
            (attr::CUDNN_ATTR_OPERATION_NORM_FWD_SCALE_DESC, R::Scale),
            (attr::CUDNN_ATTR_OPERATION_NORM_FWD_BIAS_DESC, R::Bias),
            (attr::CUDNN_ATTR_OPERATION_NORM_FWD_EPSILON_DESC, R::Epsilon),
            (attr::CUDNN_ATTR_OPERATION_NORM_FWD_YDESC, R::Y),
        ];
        for (a, r) in always {
            link(&mut d, t, a, r)?;
        }
        if t.roles.contains(&R::Momentum) {
            let running = [
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
            ];
            for (a, r) in running {
                link(&mut d, t, a, r)?;
            }
        }
        d.finalize()?;
        Ok(d)
    };
    in_part(build(), "norm forward")
}

/// The finalized `NORM_BACKWARD` operation: batch norm, dx, dscale and dbias from dy, x, the
/// scale and the saved mean and inverse standard deviation.
pub fn norm_backward(t: &BnTensors) -> Result<Descriptor> {
    let build = || -> Result<Descriptor> {
        let mut d = Descriptor::new(DescKind::NormBackward)?;
        d.set_one(
            attr::CUDNN_ATTR_OPERATION_NORM_BWD_MODE,
            sys::cudnnBackendNormMode_t::CUDNN_BATCH_NORM,
        )?;
        use BnRole as R;
        let all = [
            (attr::CUDNN_ATTR_OPERATION_NORM_BWD_XDESC, R::X),
            (attr::CUDNN_ATTR_OPERATION_NORM_BWD_DYDESC, R::Dy),
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
        for (a, r) in all {
            link(&mut d, t, a, r)?;
        }
        d.finalize()?;
        Ok(d)
    };
    in_part(build(), "norm backward")
}

/// Every descriptor of one BatchNorm graph, kept alive together (the operation graph and the
/// plans made from it refer to them).
#[derive(Debug)]
pub struct BnGraphParts {
    /// The tensors (kept alive: the operation refers to them).
    _tensors: BnTensors,
    /// The one operation (kept alive: the graph refers to it).
    _op: Descriptor,
    /// The finalized operation graph.
    pub graph: Descriptor,
}

impl BnGraphParts {
    /// Builds the graph of `key` on `handle`.
    pub fn build(handle: sys::cudnnHandle_t, key: &GraphBnKey) -> Result<BnGraphParts> {
        let tensors = BnTensors::build(key)?;
        let op = match key.direction {
            BnDirection::Forward => norm_forward(&tensors)?,
            BnDirection::Backward => norm_backward(&tensors)?,
        };
        let graph = operation_graph(handle, &[&op])?;
        Ok(BnGraphParts {
            _tensors: tensors,
            _op: op,
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
