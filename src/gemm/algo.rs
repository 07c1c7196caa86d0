//! Plain algorithm values: what nnfuse runs for a GEMM ([`Algo`]: a cuBLAS algorithm number or
//! the bytes of a `cublasLtMatmulAlgo_t`, never a heuristic rank), its readable cuBLASLt
//! configuration, and what a search decided ([`Choice`]). The bottom of the `gemm` module: it
//! imports nothing above it (only the names table).

use std::fmt;

use serde::{Deserialize, Serialize};

use super::names;

/// A `cublasGemmAlgo_t` value (`CUBLAS_GEMM_DEFAULT` = -1, `ALGO0..23` = 0..23,
/// `DEFAULT_TENSOR_OP` = 99, `ALGO0..15_TENSOR_OP` = 100..115).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CublasAlgo(pub i32);

impl CublasAlgo {
    /// `CUBLAS_GEMM_DEFAULT`: cuBLAS's own heuristic (the only meaningful value on sm_80+).
    pub const DEFAULT: CublasAlgo = CublasAlgo(-1);
    /// `CUBLAS_GEMM_DEFAULT_TENSOR_OP` (deprecated alias of the default on recent cuBLAS).
    pub const DEFAULT_TENSOR_OP: CublasAlgo = CublasAlgo(99);

    /// `CUBLAS_GEMM_ALGO<i>` for `i` in `0..=23`.
    pub fn algo(i: i32) -> Option<CublasAlgo> {
        (0..=23).contains(&i).then_some(CublasAlgo(i))
    }

    /// `CUBLAS_GEMM_ALGO<i>_TENSOR_OP` for `i` in `0..=15`.
    pub fn algo_tensor_op(i: i32) -> Option<CublasAlgo> {
        (0..=15).contains(&i).then_some(CublasAlgo(100 + i))
    }

    /// Whether cuBLAS defines this value (AUTOTUNE = 999 is not accepted: nnfuse does its own
    /// search).
    pub fn is_known(self) -> bool {
        matches!(self.0, -1..=23 | 99..=115)
    }

    /// The C name (`CUBLAS_GEMM_ALGO5`).
    pub fn name(self) -> String {
        match self.0 {
            -1 => "CUBLAS_GEMM_DEFAULT".into(),
            99 => "CUBLAS_GEMM_DEFAULT_TENSOR_OP".into(),
            i @ 0..=23 => format!("CUBLAS_GEMM_ALGO{i}"),
            i @ 100..=115 => format!("CUBLAS_GEMM_ALGO{}_TENSOR_OP", i - 100),
            i => format!("cublasGemmAlgo_t({i})"),
        }
    }
}

/// The bytes of a `cublasLtMatmulAlgo_t` (a plain struct of eight `u64`): a concrete,
/// fully-configured cuBLASLt kernel choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LtAlgo(pub [u64; 8]);

impl LtAlgo {
    /// 128 lower-case hex digits, 16 per word, most significant digit first.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|w| format!("{w:016x}")).collect()
    }

    /// Parses [`LtAlgo::to_hex`]'s format.
    pub fn from_hex(s: &str) -> Option<LtAlgo> {
        if s.len() != 128 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        let mut w = [0u64; 8];
        for (i, word) in w.iter_mut().enumerate() {
            *word = u64::from_str_radix(s.get(16 * i..16 * (i + 1))?, 16).ok()?;
        }
        Some(LtAlgo(w))
    }
}

/// A concrete algorithm: what nnfuse runs for a problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algo {
    /// `cublasGemmStridedBatchedEx` with this `cublasGemmAlgo_t`.
    Cublas(CublasAlgo),
    /// `cublasLtMatmul` with this algorithm.
    Lt(LtAlgo),
}

impl Algo {
    /// The cuBLAS default.
    pub const CUBLAS_DEFAULT: Algo = Algo::Cublas(CublasAlgo::DEFAULT);
}

/// The readable attributes of a cuBLASLt algorithm (`cublasLtMatmulAlgoConfigGetAttribute`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct LtConfig {
    /// `CUBLASLT_ALGO_CONFIG_ID`.
    pub algo_id: i32,
    /// `CUBLASLT_ALGO_CONFIG_TILE_ID` (`cublasLtMatmulTile_t`).
    pub tile: u32,
    /// `CUBLASLT_ALGO_CONFIG_STAGES_ID` (`cublasLtMatmulStages_t`).
    pub stages: u32,
    /// `CUBLASLT_ALGO_CONFIG_SPLITK_NUM` (1: no split).
    pub splitk: u32,
    /// `CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME` (`cublasLtReductionScheme_t`).
    pub reduction: u32,
    /// `CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING`.
    pub swizzle: u32,
    /// `CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION`.
    pub custom: u32,
    /// `CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID`.
    pub inner_shape: u32,
    /// `CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID` (`cublasLtClusterShape_t`).
    pub cluster_shape: u32,
}

impl LtConfig {
    /// The tile's name (`128x256`), when known.
    pub fn tile_name(&self) -> Option<&'static str> {
        names::tile(self.tile)
    }
    /// The stages' name (`64x4`), when known.
    pub fn stages_name(&self) -> Option<&'static str> {
        names::stages(self.stages)
    }
    /// The cluster shape's name (`2x1x1`), when known.
    pub fn cluster_name(&self) -> Option<&'static str> {
        names::cluster(self.cluster_shape)
    }
}

impl fmt::Display for LtConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let or = |n: Option<&'static str>, v: u32| n.map_or_else(|| v.to_string(), String::from);
        write!(
            f,
            "id {} tile {} stages {} splitK {} reduction {} swizzle {} custom {} inner {} cluster {}",
            self.algo_id,
            or(self.tile_name(), self.tile),
            or(self.stages_name(), self.stages),
            self.splitk,
            self.reduction,
            self.swizzle,
            self.custom,
            self.inner_shape,
            or(self.cluster_name(), self.cluster_shape)
        )
    }
}

/// Where a [`Choice`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Origin {
    /// Timed by a search in this process.
    Searched,
    /// Read from the tuning-cache file.
    File,
    /// No search happened (it failed, or was not possible): the cuBLAS default. Kept in memory
    /// only, so that a failing search is not repeated on every call.
    Fallback,
}

/// The algorithm chosen for a problem key (`Key`), with what the search measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    /// The algorithm.
    pub algo: Algo,
    /// Its readable attributes (cuBLASLt only).
    pub config: Option<LtConfig>,
    /// Workspace bytes it needs (cuBLASLt only; 0 otherwise).
    pub workspace: usize,
    /// Its median time per GEMM when searched (µs; NaN if unknown).
    pub median_us: f64,
    /// The cuBLAS default's median time in the same search (µs; NaN if unknown).
    pub default_us: f64,
    /// Candidates that were timed or rejected in the search (0 if unknown).
    pub candidates: u32,
    /// Where it came from.
    pub origin: Origin,
}

impl Choice {
    /// The cuBLAS default without measurements.
    pub fn fallback() -> Choice {
        Choice {
            algo: Algo::CUBLAS_DEFAULT,
            config: None,
            workspace: 0,
            median_us: f64::NAN,
            default_us: f64::NAN,
            candidates: 0,
            origin: Origin::Fallback,
        }
    }

    /// A short description (`cuBLAS CUBLAS_GEMM_DEFAULT`, `cuBLASLt id 66 tile 128x256 ...`).
    pub fn label(&self) -> String {
        match (&self.algo, &self.config) {
            (Algo::Cublas(a), _) => format!("cuBLAS {}", a.name()),
            (Algo::Lt(_), Some(c)) => format!("cuBLASLt {c}"),
            (Algo::Lt(_), None) => "cuBLASLt (attributes unknown)".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_rejects() {
        let a = LtAlgo([0, 1, u64::MAX, 0x0123_4567_89ab_cdef, 5, 6, 7, 8]);
        let h = a.to_hex();
        assert_eq!(h.len(), 128);
        assert_eq!(LtAlgo::from_hex(&h), Some(a));
        assert_eq!(LtAlgo::from_hex(&h[1..]), None);
        assert_eq!(LtAlgo::from_hex(&h.replace('f', "g")), None);
        assert_eq!(LtAlgo::from_hex(&format!("+{}", &h[1..])), None);
    }

    #[test]
    fn cublas_algo_names() {
        assert_eq!(CublasAlgo::DEFAULT.name(), "CUBLAS_GEMM_DEFAULT");
        assert_eq!(
            CublasAlgo::algo(5).map(|a| a.name()).as_deref(),
            Some("CUBLAS_GEMM_ALGO5")
        );
        assert_eq!(
            CublasAlgo::algo_tensor_op(15).map(|a| a.name()).as_deref(),
            Some("CUBLAS_GEMM_ALGO15_TENSOR_OP")
        );
        assert!(CublasAlgo::algo(24).is_none());
        assert!(!CublasAlgo(999).is_known());
    }
}
