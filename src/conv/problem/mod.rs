//! Plain problem types of the convolution, at the bottom of its layers: the problem
//! ([`ConvShape`]), the [`Direction`], cuDNN's algorithm values and graph engine configurations, the operand addresses a path
//! takes, and Winograd's geometry. Everything above imports these — the plan, the FFI, the
//! launchers, the dispatcher and the f64 reference — and this module imports nothing of the
//! convolution or the reference (only `dtype`, `layout` and `error`).

mod cudnn_values;
mod direct_filter;
mod direction;
mod dual;
mod graph_engine;
mod operands;
mod shape;
mod stem;
mod tiled;
mod winograd;

pub use cudnn_values::{CudnnAlgo, CudnnMath, CudnnPerf};
pub(crate) use direct_filter::{
    direct_filter_refusal, filter_grad_grid, FilterGradGrid, CT, KT, SEG,
};
pub use direction::Direction;
pub(crate) use dual::{dual_refusal, dual_shape};
pub use graph_engine::{GraphEngine, MAX_GRAPH_KNOBS};
pub(crate) use operands::{BwdDataPtrs, BwdFilterPtrs, CudnnPtrs, FwdPtrs};
pub use shape::ConvShape;
pub(crate) use stem::{
    column_tiles, stem_filter_refusal, stem_forward_grid, stem_forward_refusal, stem_grid, StemGrid,
};
pub(crate) use tiled::{quarter, tiled_bytes, tiled_refusal, tiled_shape, tiled_x_bytes};
pub use winograd::{
    fused_eligible, winograd_backward_data_eligible, winograd_dims, winograd_equivalent,
    winograd_forward_eligible, WinogradDims, WinogradEngine, WinogradGeometry, WinogradTile,
};
