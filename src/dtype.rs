//! Element types nnfuse computes on, and what each maps to in cuDNN, cuBLAS and the kernels.

use std::fmt;
use std::str::FromStr;

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};

use crate::error::Error;

/// Activation element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
}

impl DType {
    /// Every supported type.
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Lower-case name (`f32`, `f16`, `bf16`), also the suffix of kernel names.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }

    /// Relative tolerance against an f64 reference (DEVELOPERS.md: f32 1e-5, halves 1e-2).
    pub const fn tolerance(self) -> f64 {
        match self {
            DType::F32 => 1e-5,
            DType::F16 | DType::BF16 => 1e-2,
        }
    }

    /// cuDNN's data type.
    pub fn cudnn(self) -> cudarc::cudnn::sys::cudnnDataType_t {
        use cudarc::cudnn::sys::cudnnDataType_t as D;
        match self {
            DType::F32 => D::CUDNN_DATA_FLOAT,
            DType::F16 => D::CUDNN_DATA_HALF,
            DType::BF16 => D::CUDNN_DATA_BFLOAT16,
        }
    }

    /// CUDA's data type (cuBLAS / cuBLASLt).
    pub fn cuda(self) -> cudarc::cublas::sys::cudaDataType {
        use cudarc::cublas::sys::cudaDataType as D;
        match self {
            DType::F32 => D::CUDA_R_32F,
            DType::F16 => D::CUDA_R_16F,
            DType::BF16 => D::CUDA_R_16BF,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float" | "float32" => Ok(DType::F32),
            "f16" | "half" | "float16" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            _ => Err(Error::invalid(
                "dtype",
                format!("{s:?} is not one of f32, f16, bf16"),
            )),
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A Rust element type that nnfuse accepts in device buffers: `f32`, `half::f16`, `half::bf16`.
pub trait Element:
    sealed::Sealed + DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + fmt::Debug + 'static
{
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Widen to f64 (references, tests).
    fn to_f64(self) -> f64;
    /// Round from f64 (nearest).
    fn from_f64(v: f64) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_print_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        let e = "f64".parse::<DType>().unwrap_err();
        assert_eq!(e.argument(), Some("dtype"));
    }

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(DType::F32.size(), std::mem::size_of::<f32>());
        assert_eq!(DType::F16.size(), std::mem::size_of::<f16>());
        assert_eq!(DType::BF16.size(), std::mem::size_of::<bf16>());
        assert_eq!(<bf16 as Element>::DTYPE, DType::BF16);
    }
}
