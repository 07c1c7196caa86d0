//! Plain problem types of the convolution, at the bottom of its layers: the problem
//! ([`ConvShape`]), the [`Direction`], cuDNN's algorithm values and graph engine configurations, the operand addresses a path
//! takes, and Winograd's geometry. Everything above imports these — the plan, the FFI, the
//! launchers, the dispatcher and the f64 reference — and this module imports nothing of the
//! convolution or the reference (only `dtype`, `layout` and `error`).

mod cudnn_values;
mod direction;
mod dual;
mod graph_engine;
mod operands;
mod shape;
mod winograd;

pub use cudnn_values::{CudnnAlgo, CudnnMath, CudnnPerf};
pub use direction::Direction;
pub(crate) use dual::{dual_refusal, dual_shape};
pub use graph_engine::{GraphEngine, MAX_GRAPH_KNOBS};
pub(crate) use operands::{BwdDataPtrs, BwdFilterPtrs, CudnnPtrs, FwdPtrs};
pub use shape::ConvShape;
pub use winograd::{
    fused_eligible, winograd_backward_data_eligible, winograd_dims, winograd_equivalent,
    winograd_forward_eligible, WinogradDims, WinogradEngine, WinogradGeometry, WinogradTile,
};
