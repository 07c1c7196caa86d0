//! The f64 CPU reference of [`super::ConvBnInference`]: the convolution with the original
//! filter ([`crate::reference::conv::conv2d`]), BatchNorm with the running statistics,
//! `+ shortcut`, ReLU — unfolded, so that it checks the folding too.

use super::fold::{fold, BnHost};
use crate::conv::ConvShape;
use crate::error::{Error, Result};
use crate::layout::TensorFormat;

/// `y = [relu](bn(conv(x, w)) [+ shortcut])` in f64, in `shape`'s layout. Errors: as
/// [`crate::reference::conv::conv2d`] and [`super::fold()`] (naming the argument), and
/// `shortcut` when its length is not the output's.
pub fn reference_forward(
    shape: &ConvShape,
    x: &[f64],
    w: &[f64],
    bn: &BnHost<'_>,
    shortcut: Option<&[f64]>,
    relu: bool,
) -> Result<Vec<f64>> {
    // The scale and bias come from the folding's checked arithmetic; the filter stays unfolded.
    let scale_bias = fold(shape, w, bn)?;
    let mut y = crate::reference::conv::conv2d(shape, x, w)?;
    if let Some(z) = shortcut {
        if z.len() != y.len() {
            return Err(Error::invalid(
                "shortcut",
                format!("length {}, expected n*c_out*oh*ow = {}", z.len(), y.len()),
            ));
        }
    }
    let (oh, ow) = shape.out_hw()?;
    let k = shape.c_out;
    for (i, v) in y.iter_mut().enumerate() {
        let c = match shape.format {
            TensorFormat::Nhwc => i % k,
            TensorFormat::Nchw => (i / (oh * ow)) % k,
        };
        let bn_out = (*v - bn.running_mean[c]) * scale_bias.scale[c] + bn.beta[c];
        let sum = bn_out + shortcut.map_or(0.0, |z| z[i]);
        *v = if relu { sum.max(0.0) } else { sum };
    }
    Ok(y)
}
