//! f64 CPU references of every nnfuse operation. Public, so that users can check their own
//! results; slow and simple on purpose (plain loops, f64 accumulation).
//!
//! Layout conventions match the GPU APIs: row-major tensors; BatchNorm over `(outer, c, inner)`
//! from `(shape, axis)`; GEMM column-major as cuBLAS; the bitmask layout of
//! [`activation`] (bit `i` of word `w` is element `32*w + i`, tail bits zero).

pub mod activation;
pub mod batchnorm;
pub mod conv;
pub mod gemm;
pub mod winograd;
