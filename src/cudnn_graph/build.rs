//! Builders of one convolution's graph through cuDNN's backend API, in the order cuDNN needs
//! them: tensors → convolution → operation → operation graph → heuristics (engine configs and
//! their notes) → execution plan → variant pack → execute. Each builder sets every attribute
//! with a checked status and finalizes; no decisions here (the policy lives in
//! [`super::notes`], the choice in [`super::graph_conv`]).

use std::sync::OnceLock;

use cudarc::cudnn::sys;

use crate::conv::problem::GraphEngine;
use crate::conv::Direction;
use crate::error::{Error, Result};
use crate::reference::conv::Conv2d as ConvShape;

use super::descriptor::{
    attr, check, take_last_message, DescHandle, DescKind, Descriptor, DevPtr, RawBehaviorNote,
    RawKnobType, RawNumericalNote,
};
use super::key::GraphConvKey;
use super::layout::{conv_params, tensor_specs, Operand, TensorSpec};
use super::notes::{dedup, EngineInfo, HeurSource, NoteSet};

/// The oldest cuDNN this layer runs on: 9.0, where the graph API lives in `libcudnn_graph`.
pub const MIN_CUDNN_VERSION: usize = 90000;

/// The entry points this layer calls, looked up before the first call (cudarc panics on a
/// missing symbol).
const ENTRY_POINTS: [&str; 6] = [
    "cudnnBackendCreateDescriptor",
    "cudnnBackendDestroyDescriptor",
    "cudnnBackendSetAttribute",
    "cudnnBackendGetAttribute",
    "cudnnBackendFinalize",
    "cudnnBackendExecute",
];

/// Checks that the graph API can be called: cuDNN loadable ([`Error::LibraryMissing`]
/// otherwise), version 9 or newer and exporting every entry point used
/// ([`Error::NotSupported`] otherwise). Returns the version. A success is remembered.
pub fn available() -> Result<usize> {
    static OK: OnceLock<usize> = OnceLock::new();
    if let Some(&v) = OK.get() {
        return Ok(v);
    }
    let version = crate::context::cudnn_version()?;
    if version < MIN_CUDNN_VERSION {
        return Err(Error::NotSupported(format!(
            "the cuDNN graph route needs cuDNN 9 or newer (libcudnn_graph); the loaded cuDNN is \
             {version}"
        )));
    }
    if let Some(missing) = ENTRY_POINTS
        .iter()
        .find(|s| !super::descriptor::has_symbol(s))
    {
        return Err(Error::NotSupported(format!(
            "the loaded cuDNN {version} does not export {missing}"
        )));
    }
    Ok(*OK.get_or_init(|| version))
}

/// Logs which part of the graph a failed builder step was building, then passes the error on.
pub(super) fn in_part<T>(r: Result<T>, part: &str) -> Result<T> {
    if let Err(e) = &r {
        tracing::warn!(part, error = %e, "cuDNN graph: building a descriptor failed");
    }
    r
}

/// What every tensor descriptor is built from (a convolution's `TensorSpec` and a BatchNorm's
/// `BnTensorSpec` both say it), and the part a failure is logged under.
pub(super) struct TensorAttrs<'a> {
    pub uid: i64,
    pub dims: [i64; 4],
    pub strides: [i64; 4],
    pub data_type: sys::cudnnDataType_t,
    pub alignment: i64,
    pub is_virtual: bool,
    pub by_value: bool,
    pub part: &'a str,
}

/// A finalized tensor descriptor: data type, logical dims, strides, unique id, byte alignment,
/// virtual / by-value flags.
pub(super) fn tensor_of(t: &TensorAttrs<'_>) -> Result<Descriptor> {
    let build = || -> Result<Descriptor> {
        let mut d = Descriptor::new(DescKind::Tensor)?;
        d.set_one(attr::CUDNN_ATTR_TENSOR_DATA_TYPE, t.data_type)?;
        d.set(attr::CUDNN_ATTR_TENSOR_DIMENSIONS, &t.dims)?;
        d.set(attr::CUDNN_ATTR_TENSOR_STRIDES, &t.strides)?;
        d.set_one(attr::CUDNN_ATTR_TENSOR_UNIQUE_ID, t.uid)?;
        d.set_one(attr::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, t.alignment)?;
        d.set_one(attr::CUDNN_ATTR_TENSOR_IS_VIRTUAL, t.is_virtual)?;
        if t.by_value {
            d.set_one(attr::CUDNN_ATTR_TENSOR_IS_BY_VALUE, true)?;
        }
        d.finalize()?;
        Ok(d)
    };
    in_part(build(), t.part)
}

/// A finalized tensor descriptor of a convolution operand's `spec`.
pub fn tensor(spec: &TensorSpec) -> Result<Descriptor> {
    tensor_of(&TensorAttrs {
        uid: spec.uid,
        dims: spec.dims,
        strides: spec.strides,
        data_type: spec.dtype.cudnn(),
        alignment: spec.alignment,
        is_virtual: spec.is_virtual,
        by_value: spec.by_value,
        part: spec.operand.name(),
    })
}

/// A finalized convolution descriptor of `shape`: f32 compute, cross-correlation, two spatial
/// dimensions, symmetric padding, strides, dilations.
pub fn convolution(shape: &ConvShape) -> Result<Descriptor> {
    let [pre, post, strides, dilations] = conv_params(shape)?;
    let build = || -> Result<Descriptor> {
        let mut d = Descriptor::new(DescKind::Convolution)?;
        d.set_one(
            attr::CUDNN_ATTR_CONVOLUTION_COMP_TYPE,
            sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
        )?;
        d.set_one(
            attr::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
            sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
        )?;
        d.set_one(attr::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, 2i64)?;
        d.set(attr::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, &pre)?;
        d.set(attr::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, &post)?;
        d.set(attr::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, &strides)?;
        d.set(attr::CUDNN_ATTR_CONVOLUTION_DILATIONS, &dilations)?;
        d.finalize()?;
        Ok(d)
    };
    in_part(build(), "convolution")
}

/// The finalized convolution operation of `direction` over tensors `[x, w, y]` (dx for the data
/// gradient, dw for the filter gradient, dy for both gradients): `alpha = 1`, `beta` 0
/// (overwrite) or 1 (`accumulate`: add to the output), as floats (the scaling type of
/// f32/f16/bf16 data; only double data would take doubles).
pub fn operation(
    direction: Direction,
    conv: &Descriptor,
    tensors: [&Descriptor; 3],
    accumulate: bool,
) -> Result<Descriptor> {
    let beta = if accumulate { 1.0f32 } else { 0.0f32 };
    let [x, w, y] = tensors;
    let build = || -> Result<Descriptor> {
        let mut d;
        match direction {
            Direction::Forward => {
                d = Descriptor::new(DescKind::ConvForward)?;
                d.set_one(attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, 1.0f32)?;
                d.set_one(attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, beta)?;
                d.set_descs(
                    attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
                    &[conv],
                )?;
                d.set_descs(attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, &[x])?;
                d.set_descs(attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, &[w])?;
                d.set_descs(attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, &[y])?;
            }
            Direction::BackwardData => {
                d = Descriptor::new(DescKind::ConvBackwardData)?;
                d.set_one(
                    attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
                    1.0f32,
                )?;
                d.set_one(attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA, beta)?;
                d.set_descs(
                    attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
                    &[conv],
                )?;
                d.set_descs(attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W, &[w])?;
                d.set_descs(attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, &[x])?;
                d.set_descs(attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY, &[y])?;
            }
            Direction::BackwardFilter => {
                d = Descriptor::new(DescKind::ConvBackwardFilter)?;
                d.set_one(
                    attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
                    1.0f32,
                )?;
                d.set_one(attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA, beta)?;
                d.set_descs(
                    attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
                    &[conv],
                )?;
                d.set_descs(attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, &[x])?;
                d.set_descs(attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY, &[y])?;
                d.set_descs(attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW, &[w])?;
            }
        }
        d.finalize()?;
        Ok(d)
    };
    in_part(build(), direction.name())
}

/// The finalized operation graph of `ops` on `handle`.
pub fn operation_graph(handle: sys::cudnnHandle_t, ops: &[&Descriptor]) -> Result<Descriptor> {
    let build = || -> Result<Descriptor> {
        let mut d = Descriptor::new(DescKind::OperationGraph)?;
        d.set_descs(attr::CUDNN_ATTR_OPERATIONGRAPH_OPS, ops)?;
        d.set_one(attr::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, handle)?;
        d.finalize()?;
        Ok(d)
    };
    in_part(build(), "operation graph")
}

/// Every descriptor of one convolution graph, kept alive together (the operation graph and the
/// plans made from it refer to them).
#[derive(Debug)]
pub struct GraphParts {
    /// x (or dx), w (or dw), y (or dy).
    pub tensors: [Descriptor; 3],
    /// The convolution parameters.
    pub conv: Descriptor,
    /// The one operation.
    pub op: Descriptor,
    /// The finalized operation graph.
    pub graph: Descriptor,
}

impl GraphParts {
    /// Builds the graph of `key` on `handle`.
    pub fn build(handle: sys::cudnnHandle_t, key: &GraphConvKey) -> Result<GraphParts> {
        let specs = tensor_specs(&key.shape, key.dtype, key.alignment)?;
        let [x, w, y] = specs;
        let tensors = [tensor(&x)?, tensor(&w)?, tensor(&y)?];
        let conv = convolution(&key.shape)?;
        let [x, w, y] = &tensors;
        let op = operation(key.direction, &conv, [x, w, y], key.accumulate)?;
        let graph = operation_graph(handle, &[&op])?;
        if let Ok(n) = engine_count(&graph) {
            tracing::debug!(engines = n, "cuDNN operation graph finalized");
        }
        Ok(GraphParts {
            tensors,
            conv,
            op,
            graph,
        })
    }
}

/// One engine config listed by the heuristics, with what cuDNN says about its engine.
#[derive(Debug)]
pub struct EngineConfig {
    /// The finalized `ENGINECFG` descriptor.
    pub desc: Descriptor,
    /// Engine index, knobs, notes, source.
    pub info: EngineInfo,
}

/// Reads `N` raw enum values of `attr` from `d` (at most 32 are kept).
fn raw_notes<V: super::descriptor::AttrValue + Default>(
    d: &Descriptor,
    attr: super::descriptor::Attr,
    raw: impl Fn(V) -> u32,
) -> Result<NoteSet> {
    let mut buf = [V::default(); 32];
    let n = d.get(attr, &mut buf)?.min(buf.len());
    let values: Vec<u32> = buf[..n].iter().map(|&v| raw(v)).collect();
    Ok(NoteSet::from_raw(&values))
}

/// Room for an engine config's knob choices: at most one per knob type (cuDNN 9 has 37 to 44).
const KNOB_SLOTS: usize = 64;

/// The knob choices of an engine config, sorted by knob type. They are read into
/// [`KNOB_SLOTS`] descriptors made beforehand, as cudnn-frontend does: the count-only query
/// (a null array) answers 0 for this attribute, and an engine config rebuilt without its knobs
/// runs cuDNN's default tiles (measured: 188 against 29 µs for the same engine).
pub fn knob_choices(cfg: &Descriptor) -> Result<Vec<(u32, i64)>> {
    let mut choices = Descriptor::many(DescKind::KnobChoice, KNOB_SLOTS)?;
    let got = cfg.get_descs(attr::CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, &mut choices)?;
    let mut knobs = choices[..got]
        .iter()
        .map(|c| {
            let t = c.get_one::<RawKnobType>(attr::CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE)?;
            let v = c.get_one::<i64>(attr::CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE)?;
            Ok((t.0, v))
        })
        .collect::<Result<Vec<_>>>()?;
    knobs.sort_unstable();
    Ok(knobs)
}

/// What cuDNN says about the engine of `cfg`: index, notes and (best effort: a failure to read
/// them is logged and leaves them empty) knobs.
pub fn engine_info(cfg: &Descriptor, source: HeurSource, rank: usize) -> Result<EngineInfo> {
    let mut engine = [Descriptor::new(DescKind::Engine)?];
    cfg.get_descs(attr::CUDNN_ATTR_ENGINECFG_ENGINE, &mut engine)?;
    let [engine] = engine;
    let global_index = engine.get_one::<i64>(attr::CUDNN_ATTR_ENGINE_GLOBAL_INDEX)?;
    let numerical = raw_notes(
        &engine,
        attr::CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
        |v: RawNumericalNote| v.0,
    )?;
    let behavior = raw_notes(
        &engine,
        attr::CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE,
        |v: RawBehaviorNote| v.0,
    )?;
    let knobs = knob_choices(cfg).unwrap_or_else(|e| {
        tracing::warn!(global_index, error = %e, "cuDNN graph: knob choices unreadable");
        Vec::new()
    });
    Ok(EngineInfo {
        global_index,
        knobs,
        numerical,
        behavior,
        source,
        rank,
    })
}

/// The engine configs the heuristics of `mode` list for `graph`, in cuDNN's order.
pub fn heuristics(graph: &Descriptor, mode: HeurSource) -> Result<Vec<EngineConfig>> {
    let mut heur = Descriptor::new(DescKind::EngineHeuristics)?;
    heur.set_descs(attr::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[graph])?;
    let sys_mode = match mode {
        HeurSource::Instant => sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_INSTANT,
        HeurSource::Fallback => sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
        HeurSource::Given => {
            return Err(Error::invalid(
                "mode",
                "a given engine config is not a heuristics mode",
            ))
        }
    };
    heur.set_one(attr::CUDNN_ATTR_ENGINEHEUR_MODE, sys_mode)?;
    heur.finalize()?;
    let n = heur.count::<DescHandle>(attr::CUDNN_ATTR_ENGINEHEUR_RESULTS)?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut cfgs = Descriptor::many(DescKind::EngineConfig, n)?;
    let got = heur.get_descs(attr::CUDNN_ATTR_ENGINEHEUR_RESULTS, &mut cfgs)?;
    cfgs.truncate(got);
    let mut out = Vec::with_capacity(cfgs.len());
    for (rank, desc) in cfgs.into_iter().enumerate() {
        match engine_info(&desc, mode, rank) {
            Ok(info) => out.push(EngineConfig { desc, info }),
            Err(e) => tracing::warn!(
                mode = mode.name(),
                rank,
                error = %e,
                "cuDNN graph: an engine config's engine is unreadable; skipped"
            ),
        }
    }
    Ok(out)
}

/// The engine configs of `graph`: mode INSTANT's list, then FALLBACK's, duplicates (same
/// engine and knobs) dropped. An error only when both modes fail.
pub fn engine_configs(graph: &Descriptor) -> Result<Vec<EngineConfig>> {
    let mut all = Vec::new();
    let mut first_err = None;
    for mode in [HeurSource::Instant, HeurSource::Fallback] {
        match heuristics(graph, mode) {
            Ok(list) => all.extend(list),
            Err(e) => {
                tracing::warn!(mode = mode.name(), error = %e, "cuDNN graph heuristics failed");
                first_err.get_or_insert(e);
            }
        }
    }
    match (all.is_empty(), first_err) {
        (true, Some(e)) => Err(e),
        _ => Ok(dedup(all, |c| &c.info)),
    }
}

/// A finalized engine config of the engine with global index `index` of `graph`, with cuDNN's
/// default knobs: the configs beyond the heuristics' lists (for autotuning over every engine,
/// `0..CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT`).
pub fn engine_config_by_index(graph: &Descriptor, index: i64) -> Result<Descriptor> {
    let mut engine = Descriptor::new(DescKind::Engine)?;
    engine.set_descs(attr::CUDNN_ATTR_ENGINE_OPERATION_GRAPH, &[graph])?;
    engine.set_one(attr::CUDNN_ATTR_ENGINE_GLOBAL_INDEX, index)?;
    engine.finalize()?;
    let mut cfg = Descriptor::new(DescKind::EngineConfig)?;
    cfg.set_descs(attr::CUDNN_ATTR_ENGINECFG_ENGINE, &[&engine])?;
    cfg.finalize()?;
    Ok(cfg)
}

/// A finalized engine config of `engine` (its global index and knob choices) for `graph`: how a
/// route's or the tuning file's config is rebuilt. Errors (a `NOT_SUPPORTED` status, typically)
/// when this cuDNN has no such engine or knob for the graph.
pub fn engine_config_of(graph: &Descriptor, engine: &GraphEngine) -> Result<Descriptor> {
    let mut e = Descriptor::new(DescKind::Engine)?;
    e.set_descs(attr::CUDNN_ATTR_ENGINE_OPERATION_GRAPH, &[graph])?;
    e.set_one(attr::CUDNN_ATTR_ENGINE_GLOBAL_INDEX, engine.index())?;
    e.finalize()?;
    let mut choices = Vec::with_capacity(engine.knobs().len());
    for &(t, v) in engine.knobs() {
        let mut c = Descriptor::new(DescKind::KnobChoice)?;
        c.set_one(attr::CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, RawKnobType(t))?;
        c.set_one(attr::CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, v)?;
        c.finalize()?;
        choices.push(c);
    }
    let mut cfg = Descriptor::new(DescKind::EngineConfig)?;
    cfg.set_descs(attr::CUDNN_ATTR_ENGINECFG_ENGINE, &[&e])?;
    if !choices.is_empty() {
        let refs: Vec<&Descriptor> = choices.iter().collect();
        cfg.set_descs(attr::CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, &refs)?;
    }
    cfg.finalize()?;
    Ok(cfg)
}

/// The number of engines cuDNN has for `graph` (`CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT`).
pub fn engine_count(graph: &Descriptor) -> Result<i64> {
    graph.get_one::<i64>(attr::CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT)
}

/// A finalized execution plan and the workspace it needs.
#[derive(Debug)]
pub struct ExecutionPlan {
    desc: Descriptor,
    workspace: usize,
}

impl ExecutionPlan {
    /// Finalizes the plan of engine config `cfg` on `handle` (this is where an engine that
    /// compiles at run time compiles) and reads its workspace size.
    pub fn new(handle: sys::cudnnHandle_t, cfg: &Descriptor) -> Result<ExecutionPlan> {
        let mut d = Descriptor::new(DescKind::ExecutionPlan)?;
        d.set_one(attr::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, handle)?;
        d.set_descs(attr::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[cfg])?;
        d.finalize()?;
        let ws = d.get_one::<i64>(attr::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)?;
        let workspace = usize::try_from(ws)
            .map_err(|_| Error::NotSupported(format!("cuDNN reports a workspace of {ws} bytes")))?;
        Ok(ExecutionPlan { desc: d, workspace })
    }

    /// Workspace bytes an execution needs.
    pub fn workspace(&self) -> usize {
        self.workspace
    }

    /// The raw plan handle.
    pub fn raw(&self) -> sys::cudnnBackendDescriptor_t {
        self.desc.raw()
    }
}

/// The variant pack of one execution: the fixed unique-id array (one id per [`Operand`]), the
/// data pointers in that order and the workspace. Built once per set of pointers; a call with
/// the same pointers reuses it as it is.
#[derive(Debug)]
pub struct VariantPack {
    desc: Descriptor,
    ptrs: [u64; 3],
    workspace: u64,
}

impl VariantPack {
    /// The unique ids, in the order of the data pointers.
    pub const UIDS: [i64; 3] = [Operand::X.uid(), Operand::W.uid(), Operand::Y.uid()];

    /// A finalized pack of `ptrs` (x/dx, w/dw, y/dy) and `workspace` (0 for none).
    pub fn new(ptrs: [u64; 3], workspace: u64) -> Result<VariantPack> {
        let mut d = Descriptor::new(DescKind::VariantPack)?;
        d.set(attr::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &Self::UIDS)?;
        d.set(attr::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, &dev_ptrs(ptrs))?;
        d.set_one(
            attr::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
            DevPtr(workspace as *mut std::ffi::c_void),
        )?;
        d.finalize()?;
        Ok(VariantPack {
            desc: d,
            ptrs,
            workspace,
        })
    }

    /// Whether the pack holds exactly these pointers.
    pub fn matches(&self, ptrs: [u64; 3], workspace: u64) -> bool {
        self.ptrs == ptrs && self.workspace == workspace
    }

    /// The raw pack handle.
    pub fn raw(&self) -> sys::cudnnBackendDescriptor_t {
        self.desc.raw()
    }

    /// Probe only (tests): sets the data pointers of the already finalized pack in place. Whether
    /// cuDNN accepts this, and honours it, is what the probe finds out; nnfuse's own calls build
    /// a new pack instead.
    pub fn reset_pointers_in_place(&mut self, ptrs: [u64; 3]) -> Result<()> {
        self.desc
            .set(attr::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, &dev_ptrs(ptrs))?;
        self.ptrs = ptrs;
        Ok(())
    }
}

fn dev_ptrs(ptrs: [u64; 3]) -> [DevPtr; 3] {
    ptrs.map(|p| DevPtr(p as *mut std::ffi::c_void))
}

/// `cudnnBackendExecute(handle, plan, pack)`: queues the plan on the handle's stream.
///
/// # Safety
/// `handle` is live, bound to the stream that owns the pack's buffers and used by no other
/// thread meanwhile; the plan was built on the same handle; the pack's pointers hold the
/// plan's tensors (with the declared alignment) and workspace, outputs disjoint from inputs,
/// valid until the queued work completes.
pub unsafe fn execute(
    handle: sys::cudnnHandle_t,
    plan: &ExecutionPlan,
    pack: &VariantPack,
) -> Result<()> {
    check(
        sys::cudnnBackendExecute(handle, plan.raw(), pack.raw()),
        "cudnnBackendExecute",
    )
}

/// The message cuDNN gave for this thread's latest failure (for error summaries), or "".
pub fn last_message() -> String {
    take_last_message().unwrap_or_default()
}
