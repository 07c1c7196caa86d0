//! The pure decision behind [`super::ConvBnInference`]: which routes can run a problem, and why
//! the others cannot. No GPU calls: the libraries' presence comes in as plain flags.

use std::fmt;
use std::str::FromStr;

use crate::conv::ConvShape;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::TensorFormat;

/// Most bytes of im2col columns the GEMM route allocates for a non-pointwise convolution
/// (the bottleneck's 3x3 at batch 32 in f16 needs 116 MB).
#[doc(hidden)] // reached through `internals`
pub const MAX_COLUMN_BYTES: usize = 1 << 30;

/// How a folded `conv → BN → (+shortcut) → ReLU` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockRoute {
    /// One cuBLASLt matmul with the folded filter and the epilogue `BIAS` / `RELU_BIAS`, the
    /// shortcut as its C operand (beta = 1): NHWC only; a non-pointwise convolution first
    /// writes its im2col columns.
    GemmEpilogue,
    /// One `cudnnConvolutionBiasActivationForward` with the folded filter (bias, shortcut as
    /// `z`, ReLU or identity), algorithm `IMPLICIT_PRECOMP_GEMM`.
    CudnnFused,
    /// The unfused composition: nnfuse's `Conv2d` forward with the original filter, then
    /// nnfuse's `BatchNorm` inference with its ReLU / Add+ReLU. Always eligible.
    Unfused,
}

impl BlockRoute {
    /// Every route, the fused ones first.
    pub const ALL: [BlockRoute; 3] = [
        BlockRoute::GemmEpilogue,
        BlockRoute::CudnnFused,
        BlockRoute::Unfused,
    ];

    /// `gemm_epilogue` / `cudnn_fused` / `unfused`.
    pub const fn name(self) -> &'static str {
        match self {
            BlockRoute::GemmEpilogue => "gemm_epilogue",
            BlockRoute::CudnnFused => "cudnn_fused",
            BlockRoute::Unfused => "unfused",
        }
    }

    pub(crate) const fn index(self) -> usize {
        match self {
            BlockRoute::GemmEpilogue => 0,
            BlockRoute::CudnnFused => 1,
            BlockRoute::Unfused => 2,
        }
    }
}

impl fmt::Display for BlockRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BlockRoute {
    type Err = Error;
    fn from_str(s: &str) -> Result<BlockRoute> {
        BlockRoute::ALL
            .into_iter()
            .find(|r| r.name() == s.trim().to_ascii_lowercase())
            .ok_or_else(|| {
                Error::invalid(
                    "route",
                    format!("{s:?} is not gemm_epilogue, cudnn_fused or unfused"),
                )
            })
    }
}

/// One route's eligibility for a problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteInfo {
    /// The route.
    pub route: BlockRoute,
    /// Whether it may run the problem.
    pub eligible: bool,
    /// Why (not), in words.
    pub reason: String,
}

/// The GEMM of the GEMM route, column-major as cuBLASLt: `D[m x n] = op(A) B` with
/// `m = c_out`, `n = N·oh·ow`, `k = c_in·kh·kw`, A the KRSC filter (`k x m`, transposed),
/// B the NHWC input (pointwise) or its im2col columns (`k x n`), D the NHWC output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GemmGeometry {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// 1x1, stride 1, no padding: B is the input itself.
    pub pointwise: bool,
    /// Elements of the im2col columns (0 when pointwise).
    pub columns: usize,
}

/// Every route's eligibility for one problem and data type.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockPlan {
    /// The convolution.
    pub shape: ConvShape,
    /// The element type.
    pub dtype: DType,
    /// One entry per route, in [`BlockRoute::ALL`]'s order.
    pub routes: Vec<RouteInfo>,
    pub(crate) gemm: Option<GemmGeometry>,
}

impl BlockPlan {
    /// The entry of `r`.
    pub fn info(&self, r: BlockRoute) -> &RouteInfo {
        &self.routes[r.index()]
    }

    /// Whether `r` may run this problem.
    pub fn eligible(&self, r: BlockRoute) -> bool {
        self.info(r).eligible
    }

    /// The eligible fused routes, which the first call checks and races against the unfused
    /// composition.
    pub fn fused_candidates(&self) -> Vec<BlockRoute> {
        BlockRoute::ALL
            .into_iter()
            .filter(|&r| r != BlockRoute::Unfused && self.eligible(r))
            .collect()
    }
}

impl fmt::Display for BlockPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.shape;
        writeln!(
            f,
            "conv+BN inference {} {}: n={} c_in={} {}x{} -> c_out={} kernel {}x{} stride {:?} pad {:?} dilation {:?}",
            self.dtype, s.format, s.n, s.c_in, s.h, s.w, s.c_out, s.kh, s.kw, s.stride, s.pad,
            s.dilation
        )?;
        for r in &self.routes {
            let mark = if r.eligible { "eligible" } else { "refused" };
            writeln!(f, "  {:<14} {mark}: {}", r.route.name(), r.reason)?;
        }
        Ok(())
    }
}

/// Whether `v` fits cuBLASLt's and cuDNN's `int` sizes.
fn fits_int(v: usize) -> bool {
    v <= i32::MAX as usize
}

/// The GEMM route's geometry, or why it cannot run `s` in `dtype`.
fn gemm_rule(
    s: &ConvShape,
    dtype: DType,
    cublaslt: bool,
) -> Result<std::result::Result<GemmGeometry, String>> {
    let (oh, ow) = s.out_hw()?;
    if s.format != TensorFormat::Nhwc {
        return Ok(Err(
            "NCHW: the output channels are the GEMM's columns, and cuBLASLt's bias \
                       epilogue adds one value per row (NHWC only)"
                .into(),
        ));
    }
    if !cublaslt {
        return Ok(Err("cuBLASLt (libcublasLt) was not found".into()));
    }
    let pointwise =
        s.kh == 1 && s.kw == 1 && s.stride == (1, 1) && s.pad == (0, 0) && s.dilation == (1, 1);
    let (m, k) = (s.c_out, s.c_in * s.kh * s.kw);
    let n = s.n * oh * ow;
    if !(fits_int(m) && fits_int(n) && fits_int(k)) {
        return Ok(Err(format!(
            "the GEMM {m}x{n}x{k} exceeds cuBLASLt's int sizes"
        )));
    }
    let columns = if pointwise { 0 } else { n * k };
    let bytes = columns as u128 * dtype.size() as u128;
    if bytes > MAX_COLUMN_BYTES as u128 {
        return Ok(Err(format!(
            "the im2col columns would take {bytes} bytes, more than {MAX_COLUMN_BYTES}"
        )));
    }
    Ok(Ok(GemmGeometry {
        m,
        n,
        k,
        pointwise,
        columns,
    }))
}

/// Plans `shape` in `dtype` given which libraries load (`cudnn`, `cublaslt`): every route's
/// eligibility and reason. Pure. Errors: an invalid shape, naming the field.
pub fn plan(shape: &ConvShape, dtype: DType, cudnn: bool, cublaslt: bool) -> Result<BlockPlan> {
    shape.y_len()?;
    shape.w_len()?;
    let gemm = gemm_rule(shape, dtype, cublaslt)?;
    let gemm_info = match &gemm {
        Ok(g) if g.pointwise => RouteInfo {
            route: BlockRoute::GemmEpilogue,
            eligible: true,
            reason: format!(
                "pointwise: one cuBLASLt matmul {}x{}x{} on the input itself, bias, shortcut \
                 and ReLU in its epilogue",
                g.m, g.n, g.k
            ),
        },
        Ok(g) => RouteInfo {
            route: BlockRoute::GemmEpilogue,
            eligible: true,
            reason: format!(
                "im2col columns ({} elements), then one cuBLASLt matmul {}x{}x{} with bias, \
                 shortcut and ReLU in its epilogue",
                g.columns, g.m, g.n, g.k
            ),
        },
        Err(why) => RouteInfo {
            route: BlockRoute::GemmEpilogue,
            eligible: false,
            reason: why.clone(),
        },
    };
    let cudnn_info = RouteInfo {
        route: BlockRoute::CudnnFused,
        eligible: cudnn,
        reason: if cudnn {
            "cudnnConvolutionBiasActivationForward (IMPLICIT_PRECOMP_GEMM, the algorithm cuDNN \
             allows with ReLU) with the folded filter and bias"
                .into()
        } else {
            "cuDNN (libcudnn) was not found".into()
        },
    };
    let unfused = RouteInfo {
        route: BlockRoute::Unfused,
        eligible: true,
        reason: "Conv2d forward, then BatchNorm inference with ReLU / Add+ReLU (always available)"
            .into(),
    };
    Ok(BlockPlan {
        shape: *shape,
        dtype,
        routes: vec![gemm_info, cudnn_info, unfused],
        gemm: gemm.ok(),
    })
}
