//! The cuDNN path: owned descriptors of one convolution problem (x/y tensors, the filter, the
//! convolution per math type) and thin unsafe wrappers of cuDNN's algorithm queries
//! (`cudnnGetConvolution*Algorithm_v7`, `cudnnFindConvolution*AlgorithmEx`), workspace queries
//! and the three operations (`cudnnConvolutionForward`, `BackwardData`, `BackwardFilter`). No
//! decisions here: the dispatcher decides, these describe and call.
//!
//! - Layouts: NCHW x/y with a KCRS filter, NHWC x/y with a KRSC filter (cuDNN's
//!   `CUDNN_TENSOR_NHWC` filter format), exactly as [`crate::reference::conv`].
//! - `CUDNN_CROSS_CORRELATION` (the filter is not flipped), compute type f32 for every data type.
//! - Math type: f32 data runs with `CUDNN_FMA_MATH` (true single precision: no TF32), halves
//!   with `CUDNN_TENSOR_OP_MATH`. cuDNN's algorithm lists carry each entry's math type; an f32
//!   entry that is not FMA is dropped, a half entry runs with the descriptor of its own math type.
//! - cuDNN's results are read through a `#[repr(C)]` mirror with plain integers, so that a
//!   status or algorithm value the bindings' enums do not know is data, not undefined behaviour.

use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::{Mutex, OnceLock};

use cudarc::cudnn::sys as cudnn;

pub(crate) use super::problem::CudnnPtrs;
use super::problem::{ConvShape, Direction};
pub use super::problem::{CudnnAlgo, CudnnMath, CudnnPerf};
use crate::cudnn_graph::replay::Replays;
use crate::dtype::DType;
use crate::error::{cudnn_check, Error, Result};
use crate::layout::TensorFormat;

/// cuDNN's value of a math type.
fn math_type(m: CudnnMath) -> cudnn::cudnnMathType_t {
    use cudnn::cudnnMathType_t as M;
    match m {
        CudnnMath::Default => M::CUDNN_DEFAULT_MATH,
        CudnnMath::TensorOp => M::CUDNN_TENSOR_OP_MATH,
        CudnnMath::TensorOpAllowConversion => M::CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION,
        CudnnMath::Fma => M::CUDNN_FMA_MATH,
    }
}

/// The layout of `cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t` (all three are the same
/// struct with a different algorithm enum), with integers where the bindings have enums.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawPerf {
    algo: u32,
    status: u32,
    time: f32,
    memory: usize,
    determinism: u32,
    math_type: u32,
    reserved: [i32; 3],
}

// The mirror must match the bindings' structs exactly.
const _: () = {
    assert!(
        std::mem::size_of::<RawPerf>()
            == std::mem::size_of::<cudnn::cudnnConvolutionFwdAlgoPerf_t>()
    );
    assert!(
        std::mem::size_of::<RawPerf>()
            == std::mem::size_of::<cudnn::cudnnConvolutionBwdDataAlgoPerf_t>()
    );
    assert!(
        std::mem::size_of::<RawPerf>()
            == std::mem::size_of::<cudnn::cudnnConvolutionBwdFilterAlgoPerf_t>()
    );
    assert!(
        std::mem::align_of::<RawPerf>()
            == std::mem::align_of::<cudnn::cudnnConvolutionFwdAlgoPerf_t>()
    );
};

impl RawPerf {
    fn to_perf(self, direction: Direction) -> Option<CudnnPerf> {
        // An unknown math type cannot be set on a descriptor: such entries are dropped.
        let math = CudnnMath::from_raw(self.math_type)?;
        Some(CudnnPerf {
            algo: CudnnAlgo {
                direction,
                id: self.algo,
                math,
            },
            status: self.status,
            time_ms: self.time,
            memory: self.memory,
            deterministic: self.determinism == 1,
            math_raw: self.math_type,
        })
    }
}

fn fwd_algo(id: u32) -> Result<cudnn::cudnnConvolutionFwdAlgo_t> {
    use cudnn::cudnnConvolutionFwdAlgo_t as A;
    Ok(match id {
        0 => A::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        1 => A::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        2 => A::CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        3 => A::CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        4 => A::CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        5 => A::CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        6 => A::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        7 => A::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
        _ => return Err(unknown_algo(Direction::Forward, id)),
    })
}

fn bwd_data_algo(id: u32) -> Result<cudnn::cudnnConvolutionBwdDataAlgo_t> {
    use cudnn::cudnnConvolutionBwdDataAlgo_t as A;
    Ok(match id {
        0 => A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
        1 => A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
        2 => A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
        3 => A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
        4 => A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
        5 => A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
        _ => return Err(unknown_algo(Direction::BackwardData, id)),
    })
}

fn bwd_filter_algo(id: u32) -> Result<cudnn::cudnnConvolutionBwdFilterAlgo_t> {
    use cudnn::cudnnConvolutionBwdFilterAlgo_t as A;
    Ok(match id {
        0 => A::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
        1 => A::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
        2 => A::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
        3 => A::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
        4 => A::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD,
        5 => A::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED,
        6 => A::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING,
        _ => return Err(unknown_algo(Direction::BackwardFilter, id)),
    })
}

fn unknown_algo(d: Direction, id: u32) -> Error {
    Error::invalid(
        "cudnn_algo",
        format!(
            "{id} is not a cuDNN {} algorithm this build knows",
            d.name()
        ),
    )
}

/// An owned 4-D `cudnnTensorDescriptor_t`.
#[derive(Debug)]
pub(crate) struct Tensor4d(pub(crate) cudnn::cudnnTensorDescriptor_t);

// SAFETY: written once at creation, only read afterwards; cuDNN allows concurrent reads.
unsafe impl Send for Tensor4d {}
unsafe impl Sync for Tensor4d {}

fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::invalid(
            "shape",
            format!(
                "{what} = {v} exceeds cuDNN's int sizes (at most {})",
                i32::MAX
            ),
        )
    })
}

impl Tensor4d {
    pub(crate) fn new(format: TensorFormat, dtype: DType, dims: [usize; 4]) -> Result<Tensor4d> {
        let [n, c, h, w] = [
            int(dims[0], "n")?,
            int(dims[1], "channels")?,
            int(dims[2], "height")?,
            int(dims[3], "width")?,
        ];
        let mut d = MaybeUninit::uninit();
        // SAFETY: valid out-pointer.
        cudnn_check(
            unsafe { cudnn::cudnnCreateTensorDescriptor(d.as_mut_ptr()) },
            "cudnnCreateTensorDescriptor",
        )?;
        // SAFETY: initialised by the successful call.
        let t = Tensor4d(unsafe { d.assume_init() });
        // SAFETY: fresh descriptor; positive int dims.
        cudnn_check(
            unsafe {
                cudnn::cudnnSetTensor4dDescriptor(t.0, format.cudnn(), dtype.cudnn(), n, c, h, w)
            },
            "cudnnSetTensor4dDescriptor",
        )?;
        Ok(t)
    }
}

impl Drop for Tensor4d {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        let s = unsafe { cudnn::cudnnDestroyTensorDescriptor(self.0) };
        if s != cudnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
            tracing::warn!(?s, "cudnnDestroyTensorDescriptor failed");
        }
    }
}

/// An owned `cudnnFilterDescriptor_t` (KCRS for NCHW, KRSC for NHWC).
#[derive(Debug)]
pub(crate) struct Filter(pub(crate) cudnn::cudnnFilterDescriptor_t);

// SAFETY: as Tensor4d.
unsafe impl Send for Filter {}
unsafe impl Sync for Filter {}

impl Filter {
    pub(crate) fn new(s: &ConvShape, dtype: DType) -> Result<Filter> {
        let (k, c, r, q) = (
            int(s.c_out, "c_out")?,
            int(s.c_in, "c_in")?,
            int(s.kh, "kh")?,
            int(s.kw, "kw")?,
        );
        let mut d = MaybeUninit::uninit();
        // SAFETY: valid out-pointer.
        cudnn_check(
            unsafe { cudnn::cudnnCreateFilterDescriptor(d.as_mut_ptr()) },
            "cudnnCreateFilterDescriptor",
        )?;
        // SAFETY: initialised by the successful call.
        let f = Filter(unsafe { d.assume_init() });
        // SAFETY: fresh descriptor; the format names the filter's layout (NHWC = KRSC).
        cudnn_check(
            unsafe {
                cudnn::cudnnSetFilter4dDescriptor(f.0, dtype.cudnn(), s.format.cudnn(), k, c, r, q)
            },
            "cudnnSetFilter4dDescriptor",
        )?;
        Ok(f)
    }
}

impl Drop for Filter {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        let s = unsafe { cudnn::cudnnDestroyFilterDescriptor(self.0) };
        if s != cudnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
            tracing::warn!(?s, "cudnnDestroyFilterDescriptor failed");
        }
    }
}

/// An owned `cudnnConvolutionDescriptor_t` of one math type.
#[derive(Debug)]
pub(crate) struct Conv(pub(crate) cudnn::cudnnConvolutionDescriptor_t);

// SAFETY: as Tensor4d (the math type is set at creation, never changed).
unsafe impl Send for Conv {}
unsafe impl Sync for Conv {}

impl Conv {
    pub(crate) fn new(s: &ConvShape, math: CudnnMath) -> Result<Conv> {
        let mut d = MaybeUninit::uninit();
        // SAFETY: valid out-pointer.
        cudnn_check(
            unsafe { cudnn::cudnnCreateConvolutionDescriptor(d.as_mut_ptr()) },
            "cudnnCreateConvolutionDescriptor",
        )?;
        // SAFETY: initialised by the successful call.
        let c = Conv(unsafe { d.assume_init() });
        // SAFETY: fresh descriptor, positive strides and dilations, non-negative padding.
        cudnn_check(
            unsafe {
                cudnn::cudnnSetConvolution2dDescriptor(
                    c.0,
                    int(s.pad.0, "pad")?,
                    int(s.pad.1, "pad")?,
                    int(s.stride.0, "stride")?,
                    int(s.stride.1, "stride")?,
                    int(s.dilation.0, "dilation")?,
                    int(s.dilation.1, "dilation")?,
                    cudnn::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                    cudnn::cudnnDataType_t::CUDNN_DATA_FLOAT,
                )
            },
            "cudnnSetConvolution2dDescriptor",
        )?;
        // SAFETY: valid descriptor.
        cudnn_check(
            unsafe { cudnn::cudnnSetConvolutionMathType(c.0, math_type(math)) },
            "cudnnSetConvolutionMathType",
        )?;
        Ok(c)
    }
}

impl Drop for Conv {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        let s = unsafe { cudnn::cudnnDestroyConvolutionDescriptor(self.0) };
        if s != cudnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
            tracing::warn!(?s, "cudnnDestroyConvolutionDescriptor failed");
        }
    }
}

/// Every cuDNN descriptor of one problem and data type.
#[derive(Debug)]
pub(crate) struct CudnnConv {
    shape: ConvShape,
    /// The data type the tensor and filter descriptors describe.
    dtype: DType,
    x: Tensor4d,
    y: Tensor4d,
    w: Filter,
    /// One convolution descriptor per math type, made on first use (the primary one at once).
    conv: [OnceLock<Conv>; 4],
    /// The calls captured for replay (`cudnn_graph/replay.rs`; `cudnn_run.rs` keys them).
    pub(crate) replays: Mutex<Replays>,
}

static ONE: f32 = 1.0;
static ZERO: f32 = 0.0;

fn vp(p: u64) -> *mut c_void {
    p as *mut c_void
}

impl CudnnConv {
    /// Builds the descriptors of `s` for `dtype` and checks cuDNN's output size against
    /// [`ConvShape::out_hw`]. Needs cuDNN loadable (the caller checks
    /// [`crate::context::cudnn_present`]); makes no GPU calls.
    pub(crate) fn new(s: &ConvShape, dtype: DType) -> Result<CudnnConv> {
        if !crate::context::cudnn_present() {
            return Err(Error::LibraryMissing {
                lib: "cudnn",
                hint: "libcudnn.so.9 was not found by the dynamic loader".into(),
            });
        }
        let (oh, ow) = s.out_hw()?;
        let this = CudnnConv {
            shape: *s,
            dtype,
            x: Tensor4d::new(s.format, dtype, [s.n, s.c_in, s.h, s.w])?,
            y: Tensor4d::new(s.format, dtype, [s.n, s.c_out, oh, ow])?,
            w: Filter::new(s, dtype)?,
            conv: Default::default(),
            replays: Mutex::new(Replays::default()),
        };
        let primary = this.conv(CudnnMath::primary(dtype))?;
        let (mut n, mut c, mut h, mut w) = (0, 0, 0, 0);
        // SAFETY: valid descriptors and out-pointers.
        cudnn_check(
            unsafe {
                cudnn::cudnnGetConvolution2dForwardOutputDim(
                    primary.0, this.x.0, this.w.0, &mut n, &mut c, &mut h, &mut w,
                )
            },
            "cudnnGetConvolution2dForwardOutputDim",
        )?;
        let want = [s.n, s.c_out, oh, ow].map(|v| v as i64);
        if [n, c, h, w].map(i64::from) != want {
            return Err(Error::NotSupported(format!(
                "cuDNN computes an output of {n}x{c}x{h}x{w}, nnfuse {}x{}x{oh}x{ow}",
                s.n, s.c_out
            )));
        }
        Ok(this)
    }

    fn conv(&self, math: CudnnMath) -> Result<&Conv> {
        let slot = &self.conv[math.raw() as usize];
        if let Some(c) = slot.get() {
            return Ok(c);
        }
        let made = Conv::new(&self.shape, math)?;
        // A racing thread may have set it first; either descriptor is equivalent.
        Ok(slot.get_or_init(|| made))
    }

    /// cuDNN's heuristic algorithm list for `d` (`cudnnGetConvolution*Algorithm_v7`), in
    /// cuDNN's order, every entry (status, math type and determinism as cuDNN gives them).
    ///
    /// # Safety
    /// `h` is a live cuDNN handle used by no other thread meanwhile.
    pub(crate) unsafe fn heuristics(
        &self,
        h: cudnn::cudnnHandle_t,
        d: Direction,
    ) -> Result<Vec<CudnnPerf>> {
        let conv = self.conv(CudnnMath::primary(self.dtype))?;
        let mut raw = [RawPerf {
            algo: 0,
            status: 0,
            time: 0.0,
            memory: 0,
            determinism: 0,
            math_type: 0,
            reserved: [0; 3],
        }; 32];
        let mut got: i32 = 0;
        let req = raw.len() as i32;
        let out = raw.as_mut_ptr();
        let status = match d {
            Direction::Forward => cudnn::cudnnGetConvolutionForwardAlgorithm_v7(
                h,
                self.x.0,
                self.w.0,
                conv.0,
                self.y.0,
                req,
                &mut got,
                out.cast(),
            ),
            Direction::BackwardData => cudnn::cudnnGetConvolutionBackwardDataAlgorithm_v7(
                h,
                self.w.0,
                self.y.0,
                conv.0,
                self.x.0,
                req,
                &mut got,
                out.cast(),
            ),
            Direction::BackwardFilter => cudnn::cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                h,
                self.x.0,
                self.y.0,
                conv.0,
                self.w.0,
                req,
                &mut got,
                out.cast(),
            ),
        };
        cudnn_check(status, heuristic_call(d))?;
        Ok(raw[..got.clamp(0, req) as usize]
            .iter()
            .filter_map(|r| r.to_perf(d))
            .collect())
    }

    /// cuDNN's Find (`cudnnFindConvolution*AlgorithmEx`): runs every algorithm that fits the
    /// workspace on the given operands (the output operand is overwritten) and returns the list
    /// sorted by cuDNN's measured time.
    ///
    /// # Safety
    /// `h` is a live cuDNN handle bound to the stream that owns the operands, used by no other
    /// thread meanwhile; `p` holds the problem's extents of the data type; `ws` holds `ws_bytes`.
    pub(crate) unsafe fn find(
        &self,
        h: cudnn::cudnnHandle_t,
        d: Direction,
        p: CudnnPtrs,
        ws: u64,
        ws_bytes: usize,
    ) -> Result<Vec<CudnnPerf>> {
        let conv = self.conv(CudnnMath::primary(self.dtype))?;
        let mut raw = [RawPerf {
            algo: 0,
            status: 0,
            time: 0.0,
            memory: 0,
            determinism: 0,
            math_type: 0,
            reserved: [0; 3],
        }; 32];
        let mut got: i32 = 0;
        let req = raw.len() as i32;
        let out = raw.as_mut_ptr();
        let status = match d {
            Direction::Forward => cudnn::cudnnFindConvolutionForwardAlgorithmEx(
                h,
                self.x.0,
                vp(p.x),
                self.w.0,
                vp(p.w),
                conv.0,
                self.y.0,
                vp(p.y),
                req,
                &mut got,
                out.cast(),
                vp(ws),
                ws_bytes,
            ),
            Direction::BackwardData => cudnn::cudnnFindConvolutionBackwardDataAlgorithmEx(
                h,
                self.w.0,
                vp(p.w),
                self.y.0,
                vp(p.y),
                conv.0,
                self.x.0,
                vp(p.x),
                req,
                &mut got,
                out.cast(),
                vp(ws),
                ws_bytes,
            ),
            Direction::BackwardFilter => cudnn::cudnnFindConvolutionBackwardFilterAlgorithmEx(
                h,
                self.x.0,
                vp(p.x),
                self.y.0,
                vp(p.y),
                conv.0,
                self.w.0,
                vp(p.w),
                req,
                &mut got,
                out.cast(),
                vp(ws),
                ws_bytes,
            ),
        };
        cudnn_check(status, find_call(d))?;
        Ok(raw[..got.clamp(0, req) as usize]
            .iter()
            .filter_map(|r| r.to_perf(d))
            .collect())
    }

    /// Workspace bytes `a` needs for this problem.
    ///
    /// # Safety
    /// `h` is a live cuDNN handle used by no other thread meanwhile.
    pub(crate) unsafe fn workspace_size(
        &self,
        h: cudnn::cudnnHandle_t,
        a: CudnnAlgo,
    ) -> Result<usize> {
        let conv = self.conv(a.math)?;
        let mut bytes = 0usize;
        let status = match a.direction {
            Direction::Forward => cudnn::cudnnGetConvolutionForwardWorkspaceSize(
                h,
                self.x.0,
                self.w.0,
                conv.0,
                self.y.0,
                fwd_algo(a.id)?,
                &mut bytes,
            ),
            Direction::BackwardData => cudnn::cudnnGetConvolutionBackwardDataWorkspaceSize(
                h,
                self.w.0,
                self.y.0,
                conv.0,
                self.x.0,
                bwd_data_algo(a.id)?,
                &mut bytes,
            ),
            Direction::BackwardFilter => cudnn::cudnnGetConvolutionBackwardFilterWorkspaceSize(
                h,
                self.x.0,
                self.y.0,
                conv.0,
                self.w.0,
                bwd_filter_algo(a.id)?,
                &mut bytes,
            ),
        };
        cudnn_check(status, workspace_call(a.direction))?;
        Ok(bytes)
    }

    /// Queues the convolution of `a.direction` with algorithm `a`: forward `y = conv(x, w)`,
    /// data gradient `dx = bwd_data(dy, w)` (`p.x` = dx, `p.y` = dy), filter gradient
    /// `dw = beta * dw + bwd_filter(x, dy)` (`p.w` = dw). `beta` is 0 (overwrite) or 1
    /// (accumulate); the output is not read when it is 0.
    ///
    /// # Safety
    /// `h` is a live cuDNN handle bound to the stream that owns the operands, used by no other
    /// thread meanwhile; `p` holds the problem's extents of the data type, the output disjoint
    /// from the inputs; `ws` holds `ws_bytes >=` [`CudnnConv::workspace_size`] of `a`.
    pub(crate) unsafe fn run(
        &self,
        h: cudnn::cudnnHandle_t,
        a: CudnnAlgo,
        p: CudnnPtrs,
        ws: u64,
        ws_bytes: usize,
        accumulate: bool,
    ) -> Result<()> {
        let conv = self.conv(a.math)?;
        let alpha = &ONE as *const f32 as *const c_void;
        let beta = if accumulate { &ONE } else { &ZERO } as *const f32 as *const c_void;
        let status = match a.direction {
            Direction::Forward => cudnn::cudnnConvolutionForward(
                h,
                alpha,
                self.x.0,
                vp(p.x),
                self.w.0,
                vp(p.w),
                conv.0,
                fwd_algo(a.id)?,
                vp(ws),
                ws_bytes,
                beta,
                self.y.0,
                vp(p.y),
            ),
            Direction::BackwardData => cudnn::cudnnConvolutionBackwardData(
                h,
                alpha,
                self.w.0,
                vp(p.w),
                self.y.0,
                vp(p.y),
                conv.0,
                bwd_data_algo(a.id)?,
                vp(ws),
                ws_bytes,
                beta,
                self.x.0,
                vp(p.x),
            ),
            Direction::BackwardFilter => cudnn::cudnnConvolutionBackwardFilter(
                h,
                alpha,
                self.x.0,
                vp(p.x),
                self.y.0,
                vp(p.y),
                conv.0,
                bwd_filter_algo(a.id)?,
                vp(ws),
                ws_bytes,
                beta,
                self.w.0,
                vp(p.w),
            ),
        };
        cudnn_check(status, run_call(a.direction))
    }
}

const fn heuristic_call(d: Direction) -> &'static str {
    match d {
        Direction::Forward => "cudnnGetConvolutionForwardAlgorithm_v7",
        Direction::BackwardData => "cudnnGetConvolutionBackwardDataAlgorithm_v7",
        Direction::BackwardFilter => "cudnnGetConvolutionBackwardFilterAlgorithm_v7",
    }
}

const fn find_call(d: Direction) -> &'static str {
    match d {
        Direction::Forward => "cudnnFindConvolutionForwardAlgorithmEx",
        Direction::BackwardData => "cudnnFindConvolutionBackwardDataAlgorithmEx",
        Direction::BackwardFilter => "cudnnFindConvolutionBackwardFilterAlgorithmEx",
    }
}

const fn workspace_call(d: Direction) -> &'static str {
    match d {
        Direction::Forward => "cudnnGetConvolutionForwardWorkspaceSize",
        Direction::BackwardData => "cudnnGetConvolutionBackwardDataWorkspaceSize",
        Direction::BackwardFilter => "cudnnGetConvolutionBackwardFilterWorkspaceSize",
    }
}

const fn run_call(d: Direction) -> &'static str {
    match d {
        Direction::Forward => "cudnnConvolutionForward",
        Direction::BackwardData => "cudnnConvolutionBackwardData",
        Direction::BackwardFilter => "cudnnConvolutionBackwardFilter",
    }
}

/// What the dispatcher may run from cuDNN's list: successful entries whose math type suits the
/// data type, that fit `cap` bytes of workspace, and, when `deterministic`, that cuDNN marks
/// deterministic; duplicates (same algorithm and math) dropped, cuDNN's order kept. Also says
/// what was dropped, for the plan's reasons: `(usable, excluded_fastest_by_determinism,
/// notes)`.
pub fn usable(
    list: &[CudnnPerf],
    dtype: DType,
    cap: usize,
    deterministic: bool,
) -> (Vec<CudnnPerf>, bool, Vec<String>) {
    let mut out: Vec<CudnnPerf> = Vec::new();
    let mut notes = Vec::new();
    let mut first_ok_seen = false;
    let mut excluded_fastest = false;
    for p in list {
        if p.status != 0 {
            continue;
        }
        if !p.algo.is_known() {
            notes.push(format!(
                "{}: unknown to this build, skipped",
                p.algo.label()
            ));
            continue;
        }
        if !p.algo.math.acceptable(dtype) {
            notes.push(format!(
                "{}: math {} would not be true {dtype}, skipped",
                p.algo.name(),
                p.algo.math.name()
            ));
            continue;
        }
        if dtype == DType::F32 && p.algo.is_winograd_nonfused() {
            // Measured on the H100 (cuDNN 9.19, FMA math): 4e-4 to 7e-4 relative error on f32
            // 5x5 problems in every direction, where f32 algorithms give ~1e-7 (TF32-like; the
            // heuristic's first pick for some filter gradients). Not true f32: excluded.
            notes.push(format!(
                "{}: ~5e-4 relative error in f32 (docs/CUDNN-FACTS.md), not true f32, skipped",
                p.algo.label()
            ));
            continue;
        }
        let first_ok = !first_ok_seen;
        first_ok_seen = true;
        if p.memory > cap {
            notes.push(format!(
                "{}: needs {} B of workspace, over the cap of {cap} B",
                p.algo.label(),
                p.memory
            ));
            continue;
        }
        if deterministic && !p.deterministic {
            if first_ok {
                excluded_fastest = true;
            }
            notes.push(format!(
                "{}: not deterministic, excluded by NNFUSE_DETERMINISTIC",
                p.algo.label()
            ));
            continue;
        }
        if out.iter().any(|q| q.algo == p.algo) {
            continue;
        }
        out.push(*p);
    }
    (out, excluded_fastest, notes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn perf(id: u32, math: CudnnMath, status: u32, memory: usize, det: bool) -> CudnnPerf {
        CudnnPerf {
            algo: CudnnAlgo {
                direction: Direction::BackwardFilter,
                id,
                math,
            },
            status,
            time_ms: -1.0,
            memory,
            deterministic: det,
            math_raw: math.raw(),
        }
    }

    #[test]
    fn f32_skips_winograd_nonfused() {
        let list = [
            perf(5, CudnnMath::Fma, 0, 0, true),
            perf(1, CudnnMath::Fma, 0, 0, true),
        ];
        assert_eq!(list[0].algo.name(), "WINOGRAD_NONFUSED");
        let (ok, _, notes) = usable(&list, DType::F32, usize::MAX, false);
        assert_eq!(ok.len(), 1);
        assert_eq!(ok[0].algo.id, 1);
        assert!(notes[0].contains("WINOGRAD_NONFUSED"), "{notes:?}");
        let (ok, _, _) = usable(
            &[perf(5, CudnnMath::TensorOp, 0, 0, true)],
            DType::F16,
            usize::MAX,
            false,
        );
        assert_eq!(ok.len(), 1, "halves keep it");
    }

    #[test]
    fn names_round_trip() {
        for d in Direction::ALL {
            for id in 0..8 {
                let a = CudnnAlgo {
                    direction: d,
                    id,
                    math: CudnnMath::TensorOp,
                };
                if a.is_known() {
                    assert_eq!(
                        CudnnAlgo::from_name(d, &a.name(), a.math),
                        Some(a),
                        "{d} {id}"
                    );
                } else {
                    assert_eq!(a.name(), format!("ALGO{id}"));
                }
            }
        }
        for m in CudnnMath::ALL {
            assert_eq!(CudnnMath::from_name(m.name()), Some(m));
            assert_eq!(CudnnMath::from_raw(m.raw()), Some(m));
        }
        assert_eq!(
            CudnnAlgo {
                direction: Direction::Forward,
                id: 1,
                math: CudnnMath::Fma
            }
            .label(),
            "IMPLICIT_PRECOMP_GEMM/fma"
        );
    }

    #[test]
    fn usable_filters_and_reports() {
        use CudnnMath::*;
        let list = [
            perf(1, TensorOp, 0, 10, false), // fastest, not deterministic
            perf(0, Default, 3000, 0, true), // failed status
            perf(0, Fma, 0, 0, true),
            perf(3, TensorOp, 0, 1 << 30, true), // over the cap
            perf(0, Fma, 0, 0, true),            // duplicate
            perf(9, Fma, 0, 0, true),            // unknown id
        ];
        let (u, excl, notes) = usable(&list, DType::F16, 1 << 20, true);
        assert_eq!(u.iter().map(|p| p.algo.id).collect::<Vec<_>>(), vec![0]);
        assert!(excl);
        assert_eq!(notes.len(), 3, "{notes:?}");
        let (u, excl, _) = usable(&list, DType::F16, 1 << 20, false);
        assert_eq!(u.iter().map(|p| p.algo.id).collect::<Vec<_>>(), vec![1, 0]);
        assert!(!excl);
        // f32: only FMA entries.
        let (u, _, notes) = usable(&list, DType::F32, usize::MAX, false);
        assert!(u.iter().all(|p| p.algo.math == Fma));
        assert!(notes.iter().any(|n| n.contains("would not be true f32")));
    }

    #[test]
    fn math_rules() {
        assert_eq!(CudnnMath::primary(DType::F32), CudnnMath::Fma);
        assert_eq!(CudnnMath::primary(DType::BF16), CudnnMath::TensorOp);
        assert!(!CudnnMath::Default.acceptable(DType::F32));
        assert!(CudnnMath::Default.acceptable(DType::F16));
    }
}
