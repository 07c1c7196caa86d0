//! cuDNN's algorithm, math type and algorithm-list entry as plain values: what plans, choices
//! and the tuning file carry. The conversions to and from cuDNN's C types live with the FFI
//! (`conv/cudnn.rs`); nothing here calls cuDNN.

use std::fmt;

use super::direction::Direction;
use crate::dtype::DType;

/// cuDNN's math type of a convolution descriptor (`cudnnMathType_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CudnnMath {
    /// `CUDNN_DEFAULT_MATH` (for f32 on sm_80+ this permits TF32: never used for f32).
    Default,
    /// `CUDNN_TENSOR_OP_MATH`.
    TensorOp,
    /// `CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION`.
    TensorOpAllowConversion,
    /// `CUDNN_FMA_MATH`: FMA instructions only (true fp32).
    Fma,
}

impl CudnnMath {
    /// Every math type.
    pub const ALL: [CudnnMath; 4] = [
        CudnnMath::Default,
        CudnnMath::TensorOp,
        CudnnMath::TensorOpAllowConversion,
        CudnnMath::Fma,
    ];

    /// `default`, `tensor_op`, `tensor_op_conversion`, `fma`.
    pub const fn name(self) -> &'static str {
        match self {
            CudnnMath::Default => "default",
            CudnnMath::TensorOp => "tensor_op",
            CudnnMath::TensorOpAllowConversion => "tensor_op_conversion",
            CudnnMath::Fma => "fma",
        }
    }

    /// From cuDNN's numeric value.
    pub const fn from_raw(v: u32) -> Option<CudnnMath> {
        match v {
            0 => Some(CudnnMath::Default),
            1 => Some(CudnnMath::TensorOp),
            2 => Some(CudnnMath::TensorOpAllowConversion),
            3 => Some(CudnnMath::Fma),
            _ => None,
        }
    }

    /// cuDNN's numeric value.
    pub const fn raw(self) -> u32 {
        match self {
            CudnnMath::Default => 0,
            CudnnMath::TensorOp => 1,
            CudnnMath::TensorOpAllowConversion => 2,
            CudnnMath::Fma => 3,
        }
    }

    /// Parses [`CudnnMath::name`].
    pub fn from_name(s: &str) -> Option<CudnnMath> {
        Self::ALL.into_iter().find(|m| m.name() == s)
    }

    /// The math type nnfuse asks for with `dtype` data.
    pub const fn primary(dtype: DType) -> CudnnMath {
        match dtype {
            DType::F32 => CudnnMath::Fma,
            DType::F16 | DType::BF16 => CudnnMath::TensorOp,
        }
    }

    /// Whether an algorithm of this math type may run `dtype` data: f32 only with FMA (anything
    /// else may round through TF32 or f16); halves with any.
    pub const fn acceptable(self, dtype: DType) -> bool {
        match dtype {
            DType::F32 => matches!(self, CudnnMath::Fma),
            DType::F16 | DType::BF16 => true,
        }
    }
}

/// One cuDNN algorithm of one direction, with the math type it runs under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CudnnAlgo {
    /// Forward, data gradient or filter gradient (the algorithm enums differ).
    pub direction: Direction,
    /// `cudnnConvolutionFwdAlgo_t` / `BwdDataAlgo_t` / `BwdFilterAlgo_t` value.
    pub id: u32,
    /// The math type of the descriptor it runs with.
    pub math: CudnnMath,
}

const FWD_NAMES: [&str; 8] = [
    "IMPLICIT_GEMM",
    "IMPLICIT_PRECOMP_GEMM",
    "GEMM",
    "DIRECT",
    "FFT",
    "FFT_TILING",
    "WINOGRAD",
    "WINOGRAD_NONFUSED",
];
const BWD_DATA_NAMES: [&str; 6] = [
    "ALGO_0",
    "ALGO_1",
    "FFT",
    "FFT_TILING",
    "WINOGRAD",
    "WINOGRAD_NONFUSED",
];
const BWD_FILTER_NAMES: [&str; 7] = [
    "ALGO_0",
    "ALGO_1",
    "FFT",
    "ALGO_3",
    "WINOGRAD",
    "WINOGRAD_NONFUSED",
    "FFT_TILING",
];

impl CudnnAlgo {
    /// Whether this is cuDNN's non-fused Winograd (`*_WINOGRAD_NONFUSED`) of any direction.
    pub fn is_winograd_nonfused(&self) -> bool {
        self.name() == "WINOGRAD_NONFUSED"
    }

    /// The algorithm's name without cuDNN's prefix (`IMPLICIT_PRECOMP_GEMM`), or `ALGO<id>`
    /// for a value this build does not know.
    pub fn name(&self) -> String {
        let table: &[&str] = match self.direction {
            Direction::Forward => &FWD_NAMES,
            Direction::BackwardData => &BWD_DATA_NAMES,
            Direction::BackwardFilter => &BWD_FILTER_NAMES,
        };
        table
            .get(self.id as usize)
            .map_or_else(|| format!("ALGO{}", self.id), |s| s.to_string())
    }

    /// `IMPLICIT_PRECOMP_GEMM/tensor_op`.
    pub fn label(&self) -> String {
        format!("{}/{}", self.name(), self.math.name())
    }

    /// Whether the id names an algorithm of its direction that this build can pass to cuDNN.
    pub fn is_known(&self) -> bool {
        let count = match self.direction {
            Direction::Forward => FWD_NAMES.len(),
            Direction::BackwardData => BWD_DATA_NAMES.len(),
            Direction::BackwardFilter => BWD_FILTER_NAMES.len(),
        };
        (self.id as usize) < count
    }

    /// Parses [`CudnnAlgo::name`] (or `ALGO<id>`) for `direction`.
    pub fn from_name(direction: Direction, name: &str, math: CudnnMath) -> Option<CudnnAlgo> {
        let table: &[&str] = match direction {
            Direction::Forward => &FWD_NAMES,
            Direction::BackwardData => &BWD_DATA_NAMES,
            Direction::BackwardFilter => &BWD_FILTER_NAMES,
        };
        let id = table.iter().position(|n| *n == name).map(|i| i as u32)?;
        Some(CudnnAlgo {
            direction,
            id,
            math,
        })
    }
}

impl fmt::Display for CudnnAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

/// One entry of cuDNN's algorithm list (heuristic or Find).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CudnnPerf {
    /// The algorithm and its math type.
    pub algo: CudnnAlgo,
    /// cuDNN's status for it (0 = success).
    pub status: u32,
    /// Time in ms as Find measured it (heuristic lists: cuDNN's placeholder, usually -1).
    pub time_ms: f32,
    /// Workspace bytes it needs.
    pub memory: usize,
    /// Whether cuDNN says it is deterministic.
    pub deterministic: bool,
    /// The raw math type value (kept even when unknown to this build).
    pub math_raw: u32,
}
