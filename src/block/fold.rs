//! The BatchNorm folding of inference, pure and in f64: per output channel `k`,
//! `s[k] = γ[k] / sqrt(var[k] + eps)`, the folded filter `w'[k, ..] = w[k, ..] · s[k]` and the
//! folded bias `b'[k] = β[k] − mean[k] · s[k]`, so that `bn(conv(x, w)) = conv(x, w') + b'`.

use crate::conv::ConvShape;
use crate::error::{Error, Result};

/// A convolution's filter and bias with an inference BatchNorm folded in (see [`fold`]), in f64.
#[derive(Debug, Clone, PartialEq)]
pub struct Folded {
    /// `w'`: the filter in the problem's layout (KCRS or KRSC; `c_out` outermost in both).
    pub filter: Vec<f64>,
    /// `b'`: one value per output channel.
    pub bias: Vec<f64>,
    /// `s`: the scale folded into the filter, one value per output channel.
    pub scale: Vec<f64>,
}

/// The BatchNorm parameters of an inference, on the host in f64 (γ, β, running mean and
/// variance, each of length `c_out`, and `eps`).
#[derive(Debug, Clone, Copy)]
pub struct BnHost<'a> {
    /// Scale γ.
    pub gamma: &'a [f64],
    /// Bias β.
    pub beta: &'a [f64],
    /// Running mean.
    pub running_mean: &'a [f64],
    /// Running variance.
    pub running_var: &'a [f64],
    /// Added to the variance; finite and `> 0`.
    pub eps: f64,
}

/// Checks `eps` (finite, `> 0`), naming it.
pub(crate) fn check_eps(eps: f64) -> Result<()> {
    if !(eps.is_finite() && eps > 0.0) {
        return Err(Error::invalid(
            "eps",
            format!("{eps} is not finite and > 0"),
        ));
    }
    Ok(())
}

/// Folds `bn` into the filter `w` of `shape` (pure; see the module documentation).
///
/// Errors, naming the argument: `w` not of the problem's filter length, a parameter not of
/// length `c_out`, `eps` not finite and `> 0`, a `running_var` entry for which
/// `var + eps` is not finite and `> 0`, a non-finite `gamma`, `beta` or `running_mean` entry.
pub fn fold(shape: &ConvShape, w: &[f64], bn: &BnHost<'_>) -> Result<Folded> {
    check_eps(bn.eps)?;
    let k = shape.c_out;
    let w_len = shape.w_len()?;
    if w.len() != w_len {
        return Err(Error::invalid(
            "w",
            format!("length {}, expected c_out*c_in*kh*kw = {w_len}", w.len()),
        ));
    }
    for (name, v) in [
        ("gamma", bn.gamma),
        ("beta", bn.beta),
        ("running_mean", bn.running_mean),
        ("running_var", bn.running_var),
    ] {
        if v.len() != k {
            return Err(Error::invalid(
                name,
                format!("length {}, expected c_out = {k}", v.len()),
            ));
        }
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(Error::invalid(name, format!("entry {i} is {}", v[i])));
        }
    }
    let mut scale = Vec::with_capacity(k);
    let mut bias = Vec::with_capacity(k);
    for c in 0..k {
        let d = bn.running_var[c] + bn.eps;
        if !(d.is_finite() && d > 0.0) {
            return Err(Error::invalid(
                "running_var",
                format!("entry {c}: var + eps = {d} is not finite and > 0"),
            ));
        }
        let s = bn.gamma[c] / d.sqrt();
        scale.push(s);
        bias.push(bn.beta[c] - bn.running_mean[c] * s);
    }
    let per = w_len / k.max(1);
    let filter = w
        .iter()
        .enumerate()
        .map(|(i, v)| v * scale[i / per.max(1)])
        .collect();
    Ok(Folded {
        filter,
        bias,
        scale,
    })
}
