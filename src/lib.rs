//! # nnfuse
//!
//! The fast GPU paths for the layers that dominate convolutional networks — BatchNorm
//! (+ReLU, +Add+ReLU), batched GEMM and convolution — on cuDNN and cuBLAS, with nnfuse's own
//! CUDA kernels where the vendor libraries cannot fuse or cannot run. For authors of
//! deep-learning frameworks in Rust.
//!
//! Every choice nnfuse makes is a pure, inspectable decision (plans, `tracing` events) and
//! overridable through [`Config`] or environment variables (see `docs/CONFIG.md`).
//!
//! CUDA libraries are loaded at run time: the crate builds without CUDA, and a missing library
//! is an [`Error::LibraryMissing`], not a crash.
//!
//! ```no_run
//! # fn main() -> nnfuse::Result<()> {
//! let ctx = nnfuse::Context::new(0)?;
//! println!("{}", ctx.info());
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

pub mod activation;
pub mod batchnorm;
pub mod block;
mod cache_fs;
pub mod capture;
pub mod config;
pub mod context;
pub mod conv;
mod cudnn_graph;
mod device_check;
pub mod dtype;
pub mod error;
pub mod gemm;
mod kernels;
mod launch;
pub mod layout;
mod lru;
mod profile;
pub mod reference;
mod timing;
pub(crate) mod tune;
mod util;
mod validate;

#[cfg(test)]
mod testutil;

/// What only nnfuse's own tests, benchmarks and command-line tool use: the kernel sources and
/// compiler, small device helpers, the operand checks, and each area's tuning tables. Not a
/// stable API: paths and items change without notice.
#[doc(hidden)]
pub mod internals {
    pub use crate::activation::internals as activation;
    pub use crate::batchnorm::internals as batchnorm;
    pub use crate::block::internals as block;
    pub use crate::conv::internals as conv;
    pub use crate::cudnn_graph::internals as cudnn_graph;
    pub use crate::gemm::internals as gemm;
    pub use crate::tune::internals as tune;
    /// CUDA-event timing (median of many, interleaved variants) and copy bandwidth.
    pub mod timing {
        pub use crate::timing::*;
    }
    /// The bounded least-recently-used map behind every cache.
    pub mod lru {
        pub use crate::lru::*;
    }
    /// The CUDA sources and their NVRTC compilation and disk cache.
    pub mod kernels {
        pub use crate::kernels::*;
    }
    /// Device helpers (fill, scale, add in place) for tests and benchmarks.
    pub mod util {
        pub use crate::util::*;
    }
    /// Host-time profile of cached calls by stage (`NNFUSE_PROFILE_HOST=1`).
    pub mod profile {
        pub use crate::profile::{enabled, enter, set_enabled, take, Guard, Stage, Totals, STAGES};
    }
    /// The operand checks, one at a time.
    pub mod validate {
        pub use crate::validate::*;
    }
}

pub use config::{BnImpl, BnModePolicy, Config, ConvAlgoPolicy, CudnnApi, WinogradGemmPolicy};
pub use context::{Context, DeviceInfo};
/// The cudarc crate nnfuse is built on: buffers are its `CudaSlice` / `CudaView` types, so a
/// caller needs the same major version — this re-export is it (`nnfuse::cudarc::driver::...`).
pub use cudarc;
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use layout::{infer_channel_layout, ChannelLayout, TensorFormat};

/// The README's examples, compiled by `cargo test` so that they stay true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
