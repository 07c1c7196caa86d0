//! The owned backend descriptor of cuDNN's graph API — create, set, get, finalize, destroy —
//! and the mapping of its statuses to [`Error`]. Every failure names the call and the
//! descriptor or attribute (`cudnnBackendSetAttribute(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS)`),
//! and logs cuDNN's own explanation (`cudnnGetLastErrorString`) as a `tracing` warning.
//!
//! Values cross the FFI through [`AttrValue`], which ties each Rust element type to its
//! `cudnnBackendAttributeType_t`; enum values that cuDNN writes (notes, knob types) are read as
//! raw integers so that a value this build does not know is data, not undefined behaviour.

use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr};
use std::ptr;
use std::sync::OnceLock;

use cudarc::cudnn::sys;

use crate::error::{CudnnStatus, Error, Result};

macro_rules! desc_kinds {
    ($($(#[$doc:meta])* $v:ident => $sys:ident, $short:literal;)*) => {
        /// The backend descriptor types this layer makes.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum DescKind {
            $($(#[$doc])* $v,)*
        }

        impl DescKind {
            /// cuDNN's descriptor type.
            pub const fn sys(self) -> sys::cudnnBackendDescriptorType_t {
                match self {
                    $(DescKind::$v => sys::cudnnBackendDescriptorType_t::$sys,)*
                }
            }

            /// The type's name without `CUDNN_BACKEND_` and `_DESCRIPTOR`.
            pub const fn name(self) -> &'static str {
                match self {
                    $(DescKind::$v => $short,)*
                }
            }

            const fn create_call(self) -> &'static str {
                match self {
                    $(DescKind::$v => concat!("cudnnBackendCreateDescriptor(", $short, ")"),)*
                }
            }

            const fn finalize_call(self) -> &'static str {
                match self {
                    $(DescKind::$v => concat!("cudnnBackendFinalize(", $short, ")"),)*
                }
            }
        }
    };
}

desc_kinds! {
    /// A tensor.
    Tensor => CUDNN_BACKEND_TENSOR_DESCRIPTOR, "TENSOR";
    /// Convolution parameters.
    Convolution => CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, "CONVOLUTION";
    /// The forward convolution operation.
    ConvForward => CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
        "OPERATION_CONVOLUTION_FORWARD";
    /// The data-gradient convolution operation.
    ConvBackwardData => CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
        "OPERATION_CONVOLUTION_BACKWARD_DATA";
    /// The filter-gradient convolution operation.
    ConvBackwardFilter => CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
        "OPERATION_CONVOLUTION_BACKWARD_FILTER";
    /// The normalization forward operation (BatchNorm training or inference).
    NormForward => CUDNN_BACKEND_OPERATION_NORM_FORWARD_DESCRIPTOR, "OPERATION_NORM_FORWARD";
    /// The normalization backward operation (dx, dscale, dbias).
    NormBackward => CUDNN_BACKEND_OPERATION_NORM_BACKWARD_DESCRIPTOR, "OPERATION_NORM_BACKWARD";
    /// A pointwise function (mode, math precision): the BatchNorm epilogues' ADD / RELU.
    Pointwise => CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "POINTWISE";
    /// A pointwise operation on tensors.
    OperationPointwise => CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "OPERATION_POINTWISE";
    /// Per-channel sum and sum of squares of a tensor (`GEN_STATS`, mode `SUM_SQSUM`).
    GenStats => CUDNN_BACKEND_OPERATION_GEN_STATS_DESCRIPTOR, "OPERATION_GEN_STATS";
    /// BatchNorm's statistics finalize: sums to mean, inverse std, equivalent scale and bias,
    /// running statistics.
    BnFinalize => CUDNN_BACKEND_OPERATION_BN_FINALIZE_STATISTICS_DESCRIPTOR,
        "OPERATION_BN_FINALIZE_STATISTICS";
    /// BatchNorm's backward weights: dscale, dbias and the equivalent dx coefficients.
    BnBwdWeights => CUDNN_BACKEND_OPERATION_BN_BWD_WEIGHTS_DESCRIPTOR,
        "OPERATION_BN_BWD_WEIGHTS";
    /// A graph of operations.
    OperationGraph => CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "OPERATIONGRAPH";
    /// Engine heuristics of an operation graph.
    EngineHeuristics => CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "ENGINEHEUR";
    /// An engine with its knob choices.
    EngineConfig => CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "ENGINECFG";
    /// An engine.
    Engine => CUDNN_BACKEND_ENGINE_DESCRIPTOR, "ENGINE";
    /// One knob's choice.
    KnobChoice => CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR, "KNOB_CHOICE";
    /// An execution plan.
    ExecutionPlan => CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "EXECUTION_PLAN";
    /// The device pointers of one execution.
    VariantPack => CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "VARIANT_PACK";
}

/// One attribute name with the static call names its errors carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    /// cuDNN's attribute name.
    pub name: sys::cudnnBackendAttributeName_t,
    /// `cudnnBackendSetAttribute(<name>)`.
    pub set_call: &'static str,
    /// `cudnnBackendGetAttribute(<name>)`.
    pub get_call: &'static str,
}

macro_rules! attrs {
    ($($id:ident;)*) => {
        /// The attributes this layer sets or reads, named as cuDNN spells them.
        #[allow(non_upper_case_globals, missing_docs)]
        pub mod attr {
            use super::Attr;
            use cudarc::cudnn::sys::cudnnBackendAttributeName_t as N;
            $(
                pub const $id: Attr = Attr {
                    name: N::$id,
                    set_call: concat!("cudnnBackendSetAttribute(", stringify!($id), ")"),
                    get_call: concat!("cudnnBackendGetAttribute(", stringify!($id), ")"),
                };
            )*
        }
    };
}

attrs! {
    CUDNN_ATTR_TENSOR_DATA_TYPE;
    CUDNN_ATTR_TENSOR_DIMENSIONS;
    CUDNN_ATTR_TENSOR_STRIDES;
    CUDNN_ATTR_TENSOR_UNIQUE_ID;
    CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT;
    CUDNN_ATTR_TENSOR_IS_VIRTUAL;
    CUDNN_ATTR_TENSOR_IS_BY_VALUE;
    CUDNN_ATTR_CONVOLUTION_COMP_TYPE;
    CUDNN_ATTR_CONVOLUTION_CONV_MODE;
    CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS;
    CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS;
    CUDNN_ATTR_CONVOLUTION_POST_PADDINGS;
    CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES;
    CUDNN_ATTR_CONVOLUTION_DILATIONS;
    CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA;
    CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA;
    CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC;
    CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X;
    CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W;
    CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y;
    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA;
    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA;
    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC;
    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W;
    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX;
    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY;
    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA;
    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA;
    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC;
    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW;
    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X;
    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY;
    CUDNN_ATTR_OPERATION_NORM_FWD_MODE;
    CUDNN_ATTR_OPERATION_NORM_FWD_PHASE;
    CUDNN_ATTR_OPERATION_NORM_FWD_XDESC;
    CUDNN_ATTR_OPERATION_NORM_FWD_MEAN_DESC;
    CUDNN_ATTR_OPERATION_NORM_FWD_INV_VARIANCE_DESC;
    CUDNN_ATTR_OPERATION_NORM_FWD_SCALE_DESC;
    CUDNN_ATTR_OPERATION_NORM_FWD_BIAS_DESC;
    CUDNN_ATTR_OPERATION_NORM_FWD_EPSILON_DESC;
    CUDNN_ATTR_OPERATION_NORM_FWD_EXP_AVG_FACTOR_DESC;
    CUDNN_ATTR_OPERATION_NORM_FWD_INPUT_RUNNING_MEAN_DESC;
    CUDNN_ATTR_OPERATION_NORM_FWD_INPUT_RUNNING_VAR_DESC;
    CUDNN_ATTR_OPERATION_NORM_FWD_OUTPUT_RUNNING_MEAN_DESC;
    CUDNN_ATTR_OPERATION_NORM_FWD_OUTPUT_RUNNING_VAR_DESC;
    CUDNN_ATTR_OPERATION_NORM_FWD_YDESC;
    CUDNN_ATTR_OPERATION_NORM_BWD_MODE;
    CUDNN_ATTR_OPERATION_NORM_BWD_XDESC;
    CUDNN_ATTR_OPERATION_NORM_BWD_MEAN_DESC;
    CUDNN_ATTR_OPERATION_NORM_BWD_INV_VARIANCE_DESC;
    CUDNN_ATTR_OPERATION_NORM_BWD_DYDESC;
    CUDNN_ATTR_OPERATION_NORM_BWD_SCALE_DESC;
    CUDNN_ATTR_OPERATION_NORM_BWD_DSCALE_DESC;
    CUDNN_ATTR_OPERATION_NORM_BWD_DBIAS_DESC;
    CUDNN_ATTR_OPERATION_NORM_BWD_DXDESC;
    CUDNN_ATTR_POINTWISE_MODE;
    CUDNN_ATTR_POINTWISE_MATH_PREC;
    CUDNN_ATTR_POINTWISE_NAN_PROPAGATION;
    CUDNN_ATTR_POINTWISE_RELU_LOWER_CLIP;
    CUDNN_ATTR_POINTWISE_RELU_UPPER_CLIP;
    CUDNN_ATTR_POINTWISE_RELU_LOWER_CLIP_SLOPE;
    CUDNN_ATTR_OPERATION_GENSTATS_MODE;
    CUDNN_ATTR_OPERATION_GENSTATS_MATH_PREC;
    CUDNN_ATTR_OPERATION_GENSTATS_XDESC;
    CUDNN_ATTR_OPERATION_GENSTATS_SUMDESC;
    CUDNN_ATTR_OPERATION_GENSTATS_SQSUMDESC;
    CUDNN_ATTR_OPERATION_BN_FINALIZE_STATS_MODE;
    CUDNN_ATTR_OPERATION_BN_FINALIZE_MATH_PREC;
    CUDNN_ATTR_OPERATION_BN_FINALIZE_Y_SUM_DESC;
    CUDNN_ATTR_OPERATION_BN_FINALIZE_Y_SQ_SUM_DESC;
    CUDNN_ATTR_OPERATION_BN_FINALIZE_SCALE_DESC;
    CUDNN_ATTR_OPERATION_BN_FINALIZE_BIAS_DESC;
    CUDNN_ATTR_OPERATION_BN_FINALIZE_PREV_RUNNING_MEAN_DESC;
    CUDNN_ATTR_OPERATION_BN_FINALIZE_PREV_RUNNING_VAR_DESC;
    CUDNN_ATTR_OPERATION_BN_FINALIZE_UPDATED_RUNNING_MEAN_DESC;
    CUDNN_ATTR_OPERATION_BN_FINALIZE_UPDATED_RUNNING_VAR_DESC;
    CUDNN_ATTR_OPERATION_BN_FINALIZE_SAVED_MEAN_DESC;
    CUDNN_ATTR_OPERATION_BN_FINALIZE_SAVED_INV_STD_DESC;
    CUDNN_ATTR_OPERATION_BN_FINALIZE_EQ_SCALE_DESC;
    CUDNN_ATTR_OPERATION_BN_FINALIZE_EQ_BIAS_DESC;
    CUDNN_ATTR_OPERATION_BN_FINALIZE_ACCUM_COUNT_DESC;
    CUDNN_ATTR_OPERATION_BN_FINALIZE_EPSILON_DESC;
    CUDNN_ATTR_OPERATION_BN_FINALIZE_EXP_AVERATE_FACTOR_DESC;
    CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_MATH_PREC;
    CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_MEAN_DESC;
    CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_INVSTD_DESC;
    CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_BN_SCALE_DESC;
    CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_X_DESC;
    CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_DY_DESC;
    CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_DBN_SCALE_DESC;
    CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_DBN_BIAS_DESC;
    CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_EQ_DY_SCALE_DESC;
    CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_EQ_X_SCALE_DESC;
    CUDNN_ATTR_OPERATION_BN_BWD_WEIGHTS_EQ_BIAS;
    CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR;
    CUDNN_ATTR_OPERATION_POINTWISE_XDESC;
    CUDNN_ATTR_OPERATION_POINTWISE_BDESC;
    CUDNN_ATTR_OPERATION_POINTWISE_YDESC;
    CUDNN_ATTR_OPERATION_POINTWISE_DXDESC;
    CUDNN_ATTR_OPERATION_POINTWISE_DYDESC;
    CUDNN_ATTR_OPERATIONGRAPH_HANDLE;
    CUDNN_ATTR_OPERATIONGRAPH_OPS;
    CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT;
    CUDNN_ATTR_ENGINEHEUR_MODE;
    CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH;
    CUDNN_ATTR_ENGINEHEUR_RESULTS;
    CUDNN_ATTR_ENGINECFG_ENGINE;
    CUDNN_ATTR_ENGINECFG_KNOB_CHOICES;
    CUDNN_ATTR_ENGINE_OPERATION_GRAPH;
    CUDNN_ATTR_ENGINE_GLOBAL_INDEX;
    CUDNN_ATTR_ENGINE_NUMERICAL_NOTE;
    CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE;
    CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE;
    CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE;
    CUDNN_ATTR_EXECUTION_PLAN_HANDLE;
    CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG;
    CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE;
    CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS;
    CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS;
    CUDNN_ATTR_VARIANT_PACK_WORKSPACE;
}

/// A Rust type whose values are the elements of one `cudnnBackendAttributeType_t`.
///
/// # Safety
/// `Self` has exactly the size and layout cuDNN reads or writes for `TYPE`, and every bit
/// pattern cuDNN may write for `TYPE` is a valid `Self` where the type is read.
pub unsafe trait AttrValue: Copy {
    /// The attribute type of the elements.
    const TYPE: sys::cudnnBackendAttributeType_t;
}

/// A backend descriptor handle as an attribute element (`CUDNN_TYPE_BACKEND_DESCRIPTOR`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub struct DescHandle(pub sys::cudnnBackendDescriptor_t);

/// A device address as an attribute element (`CUDNN_TYPE_VOID_PTR`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub struct DevPtr(pub *mut c_void);

/// A raw `cudnnBackendNumericalNote_t` (`CUDNN_TYPE_NUMERICAL_NOTE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct RawNumericalNote(pub u32);

/// A raw `cudnnBackendBehaviorNote_t` (`CUDNN_TYPE_BEHAVIOR_NOTE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct RawBehaviorNote(pub u32);

/// A raw `cudnnBackendKnobType_t` (`CUDNN_TYPE_KNOB_TYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct RawKnobType(pub u32);

macro_rules! attr_value {
    ($($t:ty => $ty:ident;)*) => {
        $(
            // SAFETY: the layout of each type is that of the C element of its attribute type
            // (int64_t, float, double, bool, 32-bit enums, pointers); checked in the tests.
            unsafe impl AttrValue for $t {
                const TYPE: sys::cudnnBackendAttributeType_t =
                    sys::cudnnBackendAttributeType_t::$ty;
            }
        )*
    };
}

attr_value! {
    i64 => CUDNN_TYPE_INT64;
    f32 => CUDNN_TYPE_FLOAT;
    f64 => CUDNN_TYPE_DOUBLE;
    bool => CUDNN_TYPE_BOOLEAN;
    sys::cudnnDataType_t => CUDNN_TYPE_DATA_TYPE;
    sys::cudnnConvolutionMode_t => CUDNN_TYPE_CONVOLUTION_MODE;
    sys::cudnnBackendHeurMode_t => CUDNN_TYPE_HEUR_MODE;
    sys::cudnnBackendNormMode_t => CUDNN_TYPE_NORM_MODE;
    sys::cudnnBackendNormFwdPhase_t => CUDNN_TYPE_NORM_FWD_PHASE;
    sys::cudnnPointwiseMode_t => CUDNN_TYPE_POINTWISE_MODE;
    sys::cudnnNanPropagation_t => CUDNN_TYPE_NAN_PROPOGATION;
    sys::cudnnGenStatsMode_t => CUDNN_TYPE_GENSTATS_MODE;
    sys::cudnnBnFinalizeStatsMode_t => CUDNN_TYPE_BN_FINALIZE_STATS_MODE;
    sys::cudnnHandle_t => CUDNN_TYPE_HANDLE;
    DescHandle => CUDNN_TYPE_BACKEND_DESCRIPTOR;
    DevPtr => CUDNN_TYPE_VOID_PTR;
    RawNumericalNote => CUDNN_TYPE_NUMERICAL_NOTE;
    RawBehaviorNote => CUDNN_TYPE_BEHAVIOR_NOTE;
    RawKnobType => CUDNN_TYPE_KNOB_TYPE;
}

thread_local! {
    /// cuDNN's explanation of this thread's latest failed graph call, for error summaries.
    static LAST_MESSAGE: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Whether the loaded cuDNN exports `name` (asked before calling an entry point that older
/// versions lack: cudarc panics on a missing symbol).
pub(crate) fn has_symbol(name: &str) -> bool {
    // SAFETY: only looks the symbol up; the caller checked that cuDNN can be loaded.
    unsafe { sys::culib().get::<unsafe extern "C" fn()>(name) }.is_ok()
}

/// cuDNN's message about the latest failure on this thread (`cudnnGetLastErrorString`, cuDNN
/// 9), or an empty string where the entry point is missing.
pub fn last_error_string() -> String {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    let present = || crate::context::cudnn_present() && has_symbol("cudnnGetLastErrorString");
    if !*PRESENT.get_or_init(present) {
        return String::new();
    }
    let mut buf = [0 as c_char; 1024];
    // SAFETY: the buffer holds max_size bytes; cuDNN writes a NUL-terminated string into it.
    unsafe { sys::cudnnGetLastErrorString(buf.as_mut_ptr(), buf.len()) };
    buf[buf.len() - 1] = 0;
    // SAFETY: NUL-terminated above at the latest.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .trim()
        .to_string()
}

/// The message [`check`] recorded for this thread's latest failure, taken (cleared).
pub fn take_last_message() -> Option<String> {
    LAST_MESSAGE.with(|m| m.borrow_mut().take())
}

/// Maps a graph-API status to [`Error::Cudnn`] naming `call`; a failure logs and records
/// cuDNN's own message ([`take_last_message`]).
pub fn check(status: sys::cudnnStatus_t, call: &'static str) -> Result<()> {
    if status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    let message = last_error_string();
    let status = CudnnStatus(status);
    if status.is_not_supported() {
        // Expected while engines are tried one after another; the summary carries it.
        tracing::debug!(call, %status, %message, "cuDNN graph API: not supported");
    } else {
        tracing::warn!(call, %status, %message, "cuDNN graph API call failed");
    }
    LAST_MESSAGE.with(|m| *m.borrow_mut() = Some(format!("{call}: {status}: {message}")));
    Err(Error::Cudnn { call, status })
}

/// An owned backend descriptor; destroyed on drop (a failure there is logged, never a panic).
#[derive(Debug)]
pub struct Descriptor {
    raw: sys::cudnnBackendDescriptor_t,
    kind: DescKind,
}

// SAFETY: a descriptor is a host object; nnfuse mutates it only through `&mut self`, and cuDNN
// allows finalized descriptors to be read (and plans executed) from any thread, one handle at a
// time (the Context's lock serialises executions).
unsafe impl Send for Descriptor {}
unsafe impl Sync for Descriptor {}

impl Descriptor {
    /// `cudnnBackendCreateDescriptor(kind)`. The caller has checked that cuDNN 9 is loaded
    /// ([`super::build::available`]).
    pub fn new(kind: DescKind) -> Result<Descriptor> {
        let mut raw: sys::cudnnBackendDescriptor_t = ptr::null_mut();
        // SAFETY: valid out-pointer.
        check(
            unsafe { sys::cudnnBackendCreateDescriptor(kind.sys(), &mut raw) },
            kind.create_call(),
        )?;
        if raw.is_null() {
            return Err(Error::NotSupported(format!(
                "{} returned a null descriptor",
                kind.create_call()
            )));
        }
        Ok(Descriptor { raw, kind })
    }

    /// `n` fresh descriptors of `kind` (to be filled by a getter, e.g. heuristics results).
    pub fn many(kind: DescKind, n: usize) -> Result<Vec<Descriptor>> {
        (0..n).map(|_| Descriptor::new(kind)).collect()
    }

    /// The raw handle (valid while `self` lives).
    pub fn raw(&self) -> sys::cudnnBackendDescriptor_t {
        self.raw
    }

    /// The handle as an attribute element.
    pub fn handle(&self) -> DescHandle {
        DescHandle(self.raw)
    }

    /// The descriptor's type.
    pub fn kind(&self) -> DescKind {
        self.kind
    }

    /// Sets `attr` to `values`.
    pub fn set<V: AttrValue>(&mut self, attr: Attr, values: &[V]) -> Result<()> {
        let count = i64::try_from(values.len())
            .map_err(|_| Error::invalid("values", "more elements than int64 counts"))?;
        // SAFETY: `values` holds `count` elements of the attribute type (AttrValue); cuDNN
        // copies them; descriptor handles among them are live for the call.
        check(
            unsafe {
                sys::cudnnBackendSetAttribute(
                    self.raw,
                    attr.name,
                    V::TYPE,
                    count,
                    values.as_ptr() as *const c_void,
                )
            },
            attr.set_call,
        )
    }

    /// Sets `attr` to the one value `v`.
    pub fn set_one<V: AttrValue>(&mut self, attr: Attr, v: V) -> Result<()> {
        self.set(attr, std::slice::from_ref(&v))
    }

    /// Sets `attr` to the handles of `descs`.
    pub fn set_descs(&mut self, attr: Attr, descs: &[&Descriptor]) -> Result<()> {
        let handles: Vec<DescHandle> = descs.iter().map(|d| d.handle()).collect();
        self.set(attr, &handles)
    }

    /// Reads up to `out.len()` elements of `attr` into `out`; returns how many cuDNN has (which
    /// may exceed `out.len()`: only `out.len()` were written).
    pub fn get<V: AttrValue>(&self, attr: Attr, out: &mut [V]) -> Result<usize> {
        let cap = i64::try_from(out.len())
            .map_err(|_| Error::invalid("out", "more elements than int64 counts"))?;
        let mut n: i64 = 0;
        // SAFETY: `out` has room for `cap` elements of the attribute type (AttrValue); cuDNN
        // writes at most `cap`.
        check(
            unsafe {
                sys::cudnnBackendGetAttribute(
                    self.raw,
                    attr.name,
                    V::TYPE,
                    cap,
                    &mut n,
                    out.as_mut_ptr() as *mut c_void,
                )
            },
            attr.get_call,
        )?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// How many elements of type `V` attribute `attr` holds (a get of zero elements).
    pub fn count<V: AttrValue>(&self, attr: Attr) -> Result<usize> {
        let mut n: i64 = 0;
        // SAFETY: a request for zero elements with a null array only reports the count.
        check(
            unsafe {
                sys::cudnnBackendGetAttribute(
                    self.raw,
                    attr.name,
                    V::TYPE,
                    0,
                    &mut n,
                    ptr::null_mut(),
                )
            },
            attr.get_call,
        )?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// Reads the one value of `attr`.
    pub fn get_one<V: AttrValue + Default>(&self, attr: Attr) -> Result<V> {
        let mut v = [V::default()];
        self.get(attr, &mut v)?;
        Ok(v[0])
    }

    /// Reads `attr` (descriptor elements) into the fresh descriptors `out`, returning how many
    /// cuDNN filled.
    pub fn get_descs(&self, attr: Attr, out: &mut [Descriptor]) -> Result<usize> {
        let mut handles: Vec<DescHandle> = out.iter().map(|d| d.handle()).collect();
        let n = self.get(attr, &mut handles)?;
        // cuDNN fills the descriptors it is given; the handles themselves must not change.
        if handles.iter().zip(out.iter()).any(|(h, d)| h.0 != d.raw) {
            return Err(Error::NotSupported(format!(
                "{} replaced descriptor handles instead of filling them",
                attr.get_call
            )));
        }
        Ok(n.min(out.len()))
    }

    /// `cudnnBackendFinalize`.
    pub fn finalize(&mut self) -> Result<()> {
        // SAFETY: live descriptor.
        check(
            unsafe { sys::cudnnBackendFinalize(self.raw) },
            self.kind.finalize_call(),
        )
    }
}

impl Drop for Descriptor {
    fn drop(&mut self) {
        // SAFETY: created once by cudnnBackendCreateDescriptor, destroyed once here.
        let s = unsafe { sys::cudnnBackendDestroyDescriptor(self.raw) };
        if s != sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
            tracing::warn!(kind = self.kind.name(), status = ?s, "cudnnBackendDestroyDescriptor failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::size_of;

    #[test]
    fn attribute_values_have_the_c_sizes() {
        assert_eq!(size_of::<bool>(), 1);
        assert_eq!(size_of::<sys::cudnnDataType_t>(), 4);
        assert_eq!(size_of::<sys::cudnnConvolutionMode_t>(), 4);
        assert_eq!(size_of::<sys::cudnnBackendHeurMode_t>(), 4);
        assert_eq!(size_of::<sys::cudnnBackendNormMode_t>(), 4);
        assert_eq!(size_of::<sys::cudnnBackendNormFwdPhase_t>(), 4);
        assert_eq!(size_of::<sys::cudnnPointwiseMode_t>(), 4);
        assert_eq!(size_of::<sys::cudnnNanPropagation_t>(), 4);
        assert_eq!(size_of::<sys::cudnnGenStatsMode_t>(), 4);
        assert_eq!(size_of::<sys::cudnnBnFinalizeStatsMode_t>(), 4);
        assert_eq!(size_of::<RawNumericalNote>(), 4);
        assert_eq!(size_of::<RawBehaviorNote>(), 4);
        assert_eq!(size_of::<RawKnobType>(), 4);
        assert_eq!(size_of::<DescHandle>(), size_of::<*mut c_void>());
        assert_eq!(size_of::<DevPtr>(), size_of::<*mut c_void>());
        assert_eq!(size_of::<sys::cudnnHandle_t>(), size_of::<*mut c_void>());
        assert_eq!(
            <DevPtr as AttrValue>::TYPE,
            sys::cudnnBackendAttributeType_t::CUDNN_TYPE_VOID_PTR
        );
        assert_eq!(
            <DescHandle as AttrValue>::TYPE,
            sys::cudnnBackendAttributeType_t::CUDNN_TYPE_BACKEND_DESCRIPTOR
        );
        assert_eq!(
            <f32 as AttrValue>::TYPE,
            sys::cudnnBackendAttributeType_t::CUDNN_TYPE_FLOAT
        );
    }

    #[test]
    fn call_names_say_descriptor_and_attribute() {
        assert_eq!(
            attr::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS.set_call,
            "cudnnBackendSetAttribute(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS)"
        );
        assert_eq!(
            attr::CUDNN_ATTR_ENGINEHEUR_RESULTS.get_call,
            "cudnnBackendGetAttribute(CUDNN_ATTR_ENGINEHEUR_RESULTS)"
        );
        assert_eq!(
            attr::CUDNN_ATTR_TENSOR_STRIDES.name,
            sys::cudnnBackendAttributeName_t::CUDNN_ATTR_TENSOR_STRIDES
        );
        assert_eq!(
            DescKind::ExecutionPlan.finalize_call(),
            "cudnnBackendFinalize(EXECUTION_PLAN)"
        );
        assert_eq!(
            DescKind::ConvBackwardFilter.create_call(),
            "cudnnBackendCreateDescriptor(OPERATION_CONVOLUTION_BACKWARD_FILTER)"
        );
        assert_eq!(
            DescKind::BnFinalize.create_call(),
            "cudnnBackendCreateDescriptor(OPERATION_BN_FINALIZE_STATISTICS)"
        );
        assert_eq!(
            attr::CUDNN_ATTR_OPERATION_GENSTATS_SQSUMDESC.set_call,
            "cudnnBackendSetAttribute(CUDNN_ATTR_OPERATION_GENSTATS_SQSUMDESC)"
        );
        assert_eq!(
            DescKind::VariantPack.sys(),
            sys::cudnnBackendDescriptorType_t::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR
        );
    }

    #[test]
    fn failed_status_is_a_typed_error_naming_the_call() {
        // A failure would ask the loaded cuDNN for its message: test the success path here and
        // the error's shape through the crate's status type.
        assert!(check(sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS, "x").is_ok());
        let e = Error::Cudnn {
            call: attr::CUDNN_ATTR_TENSOR_STRIDES.set_call,
            status: CudnnStatus(sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED_LAYOUT),
        };
        assert!(e.is_cudnn_not_supported());
        assert!(e.to_string().contains("CUDNN_ATTR_TENSOR_STRIDES"));
    }
}
