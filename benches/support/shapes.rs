//! The convolution shape most benches measure: 3x3, stride 1, pad 1, no dilation, NHWC.

use nnfuse::conv::ConvShape;
use nnfuse::TensorFormat;

/// A 3x3 pad-1 NHWC convolution of `n` images of `c_in` channels, `hw`×`hw`, to `c_out` channels.
pub fn square3x3(n: usize, c_in: usize, hw: usize, c_out: usize) -> ConvShape {
    ConvShape::square(n, c_in, hw, c_out, 3, TensorFormat::Nhwc)
}
