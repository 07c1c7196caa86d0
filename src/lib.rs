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
pub mod config;
pub mod context;
pub mod conv;
mod cudnn_graph;
pub mod dtype;
pub mod error;
pub mod gemm;
pub mod kernels;
pub mod layout;
pub mod lru;
pub mod reference;
pub mod timing;
pub mod util;
pub mod validate;

#[cfg(test)]
mod testutil;

/// Items only nnfuse's own tests, benches and CLI use; not part of the public API.
#[doc(hidden)]
pub mod internals {
    pub use crate::cudnn_graph::internals as cudnn_graph;
}

pub use config::{BnImpl, BnModePolicy, Config, ConvAlgoPolicy, WinogradGemmPolicy};
pub use context::{Context, DeviceInfo};
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use layout::{infer_channel_layout, ChannelLayout, TensorFormat};

/// The README's examples, compiled by `cargo test` so that they stay true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
