//! BatchNorm (+ReLU, +Add+ReLU) over one channel axis: training forward with the running
//! statistics update, inference forward, and training backward, in f64.
//!
//! **Layout.** A row-major tensor of `shape` normalised along `axis` is viewed as
//! `(outer, c, inner)` with `outer = prod(shape[..axis])`, `c = shape[axis]`,
//! `inner = prod(shape[axis+1..])`; element `(o, ch, i)` is at `(o * c + ch) * inner + i`
//! ([`BnShape::index`]). This addresses the same memory as every 4-D descriptor that
//! [`crate::layout::infer_channel_layout`] infers (channels-last is simply `inner == 1`), so one
//! reference serves both formats.
//!
//! **Statistics** are per channel over the `M = outer * inner` elements of that channel
//! (every sum runs `o` outer, `i` inner, so a channels-first tensor and its channels-last
//! permutation give bitwise-identical statistics):
//! - `mean = Σ x / M`, `var = Σ (x - mean)² / M` (biased; two-pass), used to normalise;
//! - `saved_inv_std = 1 / sqrt(var + eps)`; `x̂ = (x - mean) * saved_inv_std`;
//!   `y_pre = gamma * x̂ + beta`.
//!
//! **Running statistics** follow PyTorch's momentum convention (cuDNN's
//! `exponentialAverageFactor` is the same number):
//! `running = (1 - momentum) * running + momentum * batch_stat`, where the batch statistic for
//! `running_var` is the **unbiased** variance `var * M / (M - 1)`.
//! **`M == 1` rule:** the correction factor `M / (M - 1)` is defined as 1 when `M == 1`, so the
//! running variance is updated with the biased variance, which is exactly 0 for one element.
//! (PyTorch refuses `M == 1` in training — "Expected more than 1 value per channel" — and the
//! literal formula would give `0 / 0 = NaN`; this reference keeps the statistics finite instead.)
//!
//! **Activation** after the affine transform: none, ReLU (`y = max(y_pre, 0)`), or Add+ReLU
//! (`y = max(y_pre + z, 0)` with an addend `z` of `x`'s shape). ReLU variants also return the
//! bitmask of `pre-activation > 0` in the layout of [`super::activation`] (element index = row-major
//! index of the tensor); NaN handling is that module's.
//!
//! **Backward** (training): `dpre = dy` masked by the bitmask (for Add+ReLU the addend's
//! gradient is the same `dpre`), then per channel `dbeta = Σ dpre`, `dgamma = Σ dpre · x̂`,
//! `dx = gamma * inv_std / M * (M * dpre - dbeta - x̂ * dgamma)`, with `x̂` recomputed from `x`,
//! `saved_mean` and `saved_inv_std`.

use super::activation::{add_relu_mask_fwd, expect_len, relu_mask_bwd, relu_mask_fwd};
use crate::error::{Error, Result};

/// `(outer, c, inner)` view of a tensor normalised along one axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BnShape {
    /// Product of the dims before the channel axis.
    pub outer: usize,
    /// Channels (`shape[axis]`).
    pub c: usize,
    /// Product of the dims after the channel axis (1 for channels-last).
    pub inner: usize,
}

impl BnShape {
    /// The view of a row-major tensor of `shape` normalised along `axis`.
    ///
    /// Errors (as [`Error::InvalidArgument`]): `shape` empty, `axis >= shape.len()` (named
    /// `axis`), a zero extent (named `shape[i]`, as [`crate::layout::infer_channel_layout`]
    /// does), or an element count that overflows `usize` (named `shape`).
    pub fn new(shape: &[usize], axis: usize) -> Result<BnShape> {
        crate::layout::check_shape_axis(shape, axis)?;
        let product = |dims: &[usize]| -> Result<usize> {
            dims.iter().try_fold(1usize, |p, &d| {
                p.checked_mul(d)
                    .ok_or_else(|| Error::invalid("shape", "the element count overflows usize"))
            })
        };
        product(shape)?;
        Ok(BnShape {
            outer: product(&shape[..axis])?,
            c: shape[axis],
            inner: product(&shape[axis + 1..])?,
        })
    }

    /// Number of elements (`outer * c * inner`; saturating, so that a hand-made view too large
    /// for memory matches no buffer instead of wrapping into a small count).
    pub fn numel(&self) -> usize {
        self.outer.saturating_mul(self.c).saturating_mul(self.inner)
    }

    /// Elements per channel, `M = outer * inner`: the count the statistics average over.
    pub fn per_channel(&self) -> usize {
        self.outer.saturating_mul(self.inner)
    }

    /// Row-major offset of element `(o, ch, i)`: `(o * c + ch) * inner + i`.
    pub fn index(&self, o: usize, ch: usize, i: usize) -> usize {
        (o * self.c + ch) * self.inner + i
    }
}

/// The activation applied after the forward's affine transform.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation<'a> {
    /// `y = gamma * x̂ + beta`.
    None,
    /// `y = max(gamma * x̂ + beta, 0)`.
    Relu,
    /// `y = max(gamma * x̂ + beta + z, 0)`; `z` has `x`'s shape.
    AddRelu(&'a [f64]),
}

/// The activation's part of the backward: the forward's bitmask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationBackward<'a> {
    /// No activation: `dpre = dy`.
    None,
    /// ReLU: `dpre = dy` where the mask bit is set, else 0.
    Relu {
        /// The forward's [`BnForward::mask`].
        mask: &'a [u32],
    },
    /// Add+ReLU: as ReLU, and the addend's gradient is `dpre` too.
    AddRelu {
        /// The forward's [`BnForward::mask`].
        mask: &'a [u32],
    },
}

/// What the training forward produces.
#[derive(Debug, Clone, PartialEq)]
pub struct BnForward {
    /// The output, `x`'s shape.
    pub y: Vec<f64>,
    /// Bitmask of `pre-activation > 0` (layout of [`super::activation`]); `None` for
    /// [`Activation::None`].
    pub mask: Option<Vec<u32>>,
    /// Batch mean per channel.
    pub saved_mean: Vec<f64>,
    /// `1 / sqrt(var + eps)` per channel, with the biased batch variance.
    pub saved_inv_std: Vec<f64>,
    /// Updated running mean.
    pub running_mean: Vec<f64>,
    /// Updated running variance (with the unbiased batch variance; see the module's `M == 1`
    /// rule).
    pub running_var: Vec<f64>,
}

/// What the training backward produces.
#[derive(Debug, Clone, PartialEq)]
pub struct BnGrads {
    /// Gradient of `x`.
    pub dx: Vec<f64>,
    /// Gradient of `gamma`, per channel.
    pub dgamma: Vec<f64>,
    /// Gradient of `beta`, per channel.
    pub dbeta: Vec<f64>,
    /// Gradient of the addend `z` (equal to the masked `dy`), for
    /// [`ActivationBackward::AddRelu`] only.
    pub d_addend: Option<Vec<f64>>,
}

/// Per-channel batch mean and **biased** variance (two-pass), summed `o` outer, `i` inner.
/// Errors name `x` when `x.len() != s.numel()`.
pub fn batch_statistics(s: &BnShape, x: &[f64]) -> Result<(Vec<f64>, Vec<f64>)> {
    expect_len("x", x.len(), s.numel(), "the shape's element count")?;
    let m = s.per_channel() as f64;
    let mut mean = vec![0.0; s.c];
    let mut var = vec![0.0; s.c];
    for ch in 0..s.c {
        let mut sum = 0.0;
        for o in 0..s.outer {
            for i in 0..s.inner {
                sum += x[s.index(o, ch, i)];
            }
        }
        let mu = sum / m;
        let mut sq = 0.0;
        for o in 0..s.outer {
            for i in 0..s.inner {
                let d = x[s.index(o, ch, i)] - mu;
                sq += d * d;
            }
        }
        mean[ch] = mu;
        var[ch] = sq / m;
    }
    Ok((mean, var))
}

/// `M / (M - 1)`, defined as 1 for `M == 1` (the module's `M == 1` rule).
pub fn unbiased_factor(m: usize) -> f64 {
    if m > 1 {
        m as f64 / (m - 1) as f64
    } else {
        1.0
    }
}

/// `gamma * (x - mean) * inv_std + beta` for every element, then the activation. The caller has
/// checked `x` and the per-channel buffers ([`check_params`]); the addend is checked here.
fn affine_then_activation(
    s: &BnShape,
    x: &[f64],
    gamma: &[f64],
    beta: &[f64],
    mean: &[f64],
    inv_std: &[f64],
    act: Activation<'_>,
) -> Result<(Vec<f64>, Option<Vec<u32>>)> {
    if let Activation::AddRelu(z) = act {
        expect_len("addend", z.len(), s.numel(), "the shape's element count")?;
    }
    let mut pre = vec![0.0; s.numel()];
    for o in 0..s.outer {
        for ch in 0..s.c {
            for i in 0..s.inner {
                let k = s.index(o, ch, i);
                pre[k] = gamma[ch] * ((x[k] - mean[ch]) * inv_std[ch]) + beta[ch];
            }
        }
    }
    Ok(match act {
        Activation::None => (pre, None),
        Activation::Relu => {
            let (y, mask) = relu_mask_fwd(&pre);
            (y, Some(mask))
        }
        Activation::AddRelu(z) => {
            let (y, mask) = add_relu_mask_fwd(&pre, z)?;
            (y, Some(mask))
        }
    })
}

/// `x` has the shape's element count and every per-channel buffer `s.c` elements; errors name
/// the buffer.
fn check_params(s: &BnShape, x: &[f64], params: &[(&str, &[f64])]) -> Result<()> {
    expect_len("x", x.len(), s.numel(), "the shape's element count")?;
    for (name, p) in params {
        expect_len(name, p.len(), s.c, "the channel count")?;
    }
    Ok(())
}

/// Training forward: normalise with the batch statistics, apply the activation, and update the
/// running statistics (see the module docs for every formula and the `M == 1` rule).
///
/// Errors (as [`Error::InvalidArgument`] naming the buffer): `x` (or the addend) without
/// `s.numel()` elements, or a per-channel buffer without `s.c`.
#[allow(clippy::too_many_arguments)]
pub fn train_forward(
    s: &BnShape,
    x: &[f64],
    gamma: &[f64],
    beta: &[f64],
    running_mean: &[f64],
    running_var: &[f64],
    momentum: f64,
    eps: f64,
    act: Activation<'_>,
) -> Result<BnForward> {
    check_params(
        s,
        x,
        &[
            ("gamma", gamma),
            ("beta", beta),
            ("running_mean", running_mean),
            ("running_var", running_var),
        ],
    )?;
    let (mean, var) = batch_statistics(s, x)?;
    let inv_std: Vec<f64> = var.iter().map(|&v| 1.0 / (v + eps).sqrt()).collect();
    let (y, mask) = affine_then_activation(s, x, gamma, beta, &mean, &inv_std, act)?;
    let factor = unbiased_factor(s.per_channel());
    let new_mean = running_mean
        .iter()
        .zip(&mean)
        .map(|(&r, &b)| (1.0 - momentum) * r + momentum * b)
        .collect();
    let new_var = running_var
        .iter()
        .zip(&var)
        .map(|(&r, &b)| (1.0 - momentum) * r + momentum * (b * factor))
        .collect();
    Ok(BnForward {
        y,
        mask,
        saved_mean: mean,
        saved_inv_std: inv_std,
        running_mean: new_mean,
        running_var: new_var,
    })
}

/// Inference forward: `y = gamma * (x - running_mean) / sqrt(running_var + eps) + beta`, then
/// the activation (computed as `(x - rm) * (1 / sqrt(rv + eps))`, the training forward's
/// order). No mask: inference has no backward.
///
/// Errors as [`train_forward`].
#[allow(clippy::too_many_arguments)]
pub fn inference_forward(
    s: &BnShape,
    x: &[f64],
    gamma: &[f64],
    beta: &[f64],
    running_mean: &[f64],
    running_var: &[f64],
    eps: f64,
    act: Activation<'_>,
) -> Result<Vec<f64>> {
    check_params(
        s,
        x,
        &[
            ("gamma", gamma),
            ("beta", beta),
            ("running_mean", running_mean),
            ("running_var", running_var),
        ],
    )?;
    let inv_std: Vec<f64> = running_var
        .iter()
        .map(|&v| 1.0 / (v + eps).sqrt())
        .collect();
    Ok(affine_then_activation(s, x, gamma, beta, running_mean, &inv_std, act)?.0)
}

/// Training backward (see the module docs for the formulas).
///
/// Errors (as [`Error::InvalidArgument`] naming the buffer): `x` or `dy` without `s.numel()`
/// elements, a per-channel buffer without `s.c`, or a `mask` shorter than
/// `mask_words(s.numel())`.
pub fn backward(
    s: &BnShape,
    x: &[f64],
    dy: &[f64],
    gamma: &[f64],
    saved_mean: &[f64],
    saved_inv_std: &[f64],
    act_bwd: ActivationBackward<'_>,
) -> Result<BnGrads> {
    check_params(
        s,
        x,
        &[
            ("gamma", gamma),
            ("saved_mean", saved_mean),
            ("saved_inv_std", saved_inv_std),
        ],
    )?;
    expect_len("dy", dy.len(), s.numel(), "the shape's element count")?;
    let (dpre, d_addend) = match act_bwd {
        ActivationBackward::None => (dy.to_vec(), None),
        ActivationBackward::Relu { mask } => (relu_mask_bwd(dy, mask)?, None),
        ActivationBackward::AddRelu { mask } => {
            let d = relu_mask_bwd(dy, mask)?;
            (d.clone(), Some(d))
        }
    };
    let m = s.per_channel() as f64;
    let xhat = |k: usize, ch: usize| (x[k] - saved_mean[ch]) * saved_inv_std[ch];
    let mut dgamma = vec![0.0; s.c];
    let mut dbeta = vec![0.0; s.c];
    for ch in 0..s.c {
        for o in 0..s.outer {
            for i in 0..s.inner {
                let k = s.index(o, ch, i);
                dbeta[ch] += dpre[k];
                dgamma[ch] += dpre[k] * xhat(k, ch);
            }
        }
    }
    let mut dx = vec![0.0; s.numel()];
    for ch in 0..s.c {
        let scale = gamma[ch] * saved_inv_std[ch] / m;
        for o in 0..s.outer {
            for i in 0..s.inner {
                let k = s.index(o, ch, i);
                dx[k] = scale * (m * dpre[k] - dbeta[ch] - xhat(k, ch) * dgamma[ch]);
            }
        }
    }
    Ok(BnGrads {
        dx,
        dgamma,
        dbeta,
        d_addend,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::activation::mask_bit;

    fn close(a: &[f64], b: &[f64], tol: f64) {
        assert_eq!(a.len(), b.len(), "lengths differ");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= tol * y.abs().max(1.0),
                "element {i}: {x} vs {y}\n{a:?}\n{b:?}"
            );
        }
    }

    /// A small deterministic generator (xorshift64*), uniform in [-1, 1).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let v = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
            (v >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        }
        fn vec(&mut self, n: usize) -> Vec<f64> {
            (0..n).map(|_| self.next()).collect()
        }
    }

    #[test]
    fn shape_view_and_errors() {
        let s = BnShape::new(&[2, 3, 4, 5], 1).unwrap();
        assert_eq!((s.outer, s.c, s.inner), (2, 3, 20));
        assert_eq!((s.numel(), s.per_channel()), (120, 40));
        assert_eq!(s.index(1, 2, 3), (3 + 2) * 20 + 3);
        let s = BnShape::new(&[2, 4, 5, 3], 3).unwrap();
        assert_eq!((s.outer, s.c, s.inner), (40, 3, 1));
        let s = BnShape::new(&[7], 0).unwrap();
        assert_eq!((s.outer, s.c, s.inner), (1, 7, 1));
        let arg = |shape: &[usize], axis| {
            BnShape::new(shape, axis)
                .unwrap_err()
                .argument()
                .map(str::to_owned)
        };
        assert_eq!(arg(&[], 0).as_deref(), Some("shape"));
        assert_eq!(arg(&[2, 3], 2).as_deref(), Some("axis"));
        assert_eq!(arg(&[2, 0, 3], 1).as_deref(), Some("shape[1]"));
        assert_eq!(arg(&[usize::MAX, 2], 0).as_deref(), Some("shape"));
    }

    /// These asserted (panicked); each mismatch is now an error naming the buffer.
    #[test]
    fn length_mismatches_are_errors_naming_the_buffer() {
        let s = BnShape::new(&[3, 2], 1).unwrap();
        let (x, c, short) = ([0.0; 6], [1.0; 2], [1.0; 1]);
        let name = |e: Error| e.argument().map(str::to_owned);
        let train = |x: &[f64], g: &[f64], rv: &[f64], act| {
            train_forward(&s, x, g, &c, &c, rv, 0.1, 1e-5, act).map(drop)
        };
        assert_eq!(
            name(train(&x[..5], &c, &c, Activation::None).unwrap_err()).as_deref(),
            Some("x")
        );
        assert_eq!(
            name(train(&x, &short, &c, Activation::None).unwrap_err()).as_deref(),
            Some("gamma")
        );
        assert_eq!(
            name(train(&x, &c, &short, Activation::None).unwrap_err()).as_deref(),
            Some("running_var")
        );
        let z = [0.0; 5];
        assert_eq!(
            name(train(&x, &c, &c, Activation::AddRelu(&z)).unwrap_err()).as_deref(),
            Some("addend")
        );
        let e = inference_forward(&s, &x, &c, &short, &c, &c, 1e-5, Activation::Relu).unwrap_err();
        assert_eq!(name(e).as_deref(), Some("beta"));
        assert_eq!(
            name(batch_statistics(&s, &x[..1]).unwrap_err()).as_deref(),
            Some("x")
        );
        let bwd = |dy: &[f64], mean: &[f64], act| backward(&s, &x, dy, &c, mean, &c, act).map(drop);
        assert_eq!(
            name(bwd(&x[..4], &c, ActivationBackward::None).unwrap_err()).as_deref(),
            Some("dy")
        );
        assert_eq!(
            name(bwd(&x, &short, ActivationBackward::None).unwrap_err()).as_deref(),
            Some("saved_mean")
        );
        let e = bwd(&x, &c, ActivationBackward::Relu { mask: &[] }).unwrap_err();
        assert_eq!(name(e).as_deref(), Some("mask"));
        let e = bwd(&x, &c, ActivationBackward::AddRelu { mask: &[] }).unwrap_err();
        assert_eq!(name(e).as_deref(), Some("mask"));
        // A hand-made view too large for memory matches no buffer instead of wrapping.
        let huge = BnShape {
            outer: usize::MAX,
            c: 2,
            inner: 2,
        };
        assert_eq!(huge.numel(), usize::MAX);
        assert_eq!(
            name(batch_statistics(&huge, &x).unwrap_err()).as_deref(),
            Some("x")
        );
    }

    /// Shape [3, 2], axis 1: 3 elements in each of 2 channels (channels-last, inner = 1).
    /// Row-major x = [(o0: c0, c1), (o1: c0, c1), (o2: c0, c1)].
    ///   channel 0: x = 0, 3, 6   → mean 3, deviations -3, 0, 3, Σd² = 18, var = 18/3 = 6
    ///   channel 1: x = 10, 7, 13 → mean 10, deviations 0, -3, 3, Σd² = 18, var = 6
    /// eps = 3 → var + eps = 9 → inv_std = 1/3 → x̂: ch0 = -1, 0, 1; ch1 = 0, -1, 1.
    const X: [f64; 6] = [0.0, 10.0, 3.0, 7.0, 6.0, 13.0];
    const GAMMA: [f64; 2] = [2.0, -1.0];
    const BETA: [f64; 2] = [1.0, 0.5];
    const EPS: f64 = 3.0;

    #[test]
    fn forward_hand_computed() {
        let s = BnShape::new(&[3, 2], 1).unwrap();
        // Running stats: unbiased var = 6 * 3/2 = 9 for both channels; momentum 0.25:
        //   rm = 0.75 * [0, 1] + 0.25 * [3, 10] = [0.75, 3.25]
        //   rv = 0.75 * [1, 2] + 0.25 * [9, 9]  = [3.0, 3.75]
        let f = train_forward(
            &s,
            &X,
            &GAMMA,
            &BETA,
            &[0.0, 1.0],
            &[1.0, 2.0],
            0.25,
            EPS,
            Activation::None,
        )
        .unwrap();
        // y: ch0 = 2 * x̂ + 1 = -1, 1, 3; ch1 = -x̂ + 0.5 = 0.5, 1.5, -0.5.
        close(&f.y, &[-1.0, 0.5, 1.0, 1.5, 3.0, -0.5], 1e-15);
        assert!(f.mask.is_none());
        assert_eq!(f.saved_mean, vec![3.0, 10.0]);
        close(&f.saved_inv_std, &[1.0 / 3.0, 1.0 / 3.0], 1e-15);
        assert_eq!(f.running_mean, vec![0.75, 3.25]);
        assert_eq!(f.running_var, vec![3.0, 3.75]);

        // ReLU: y = 0, 0.5, 1, 1.5, 3, 0; positive pre-activations at 1, 2, 3, 4 → 0b011110.
        let r = train_forward(
            &s,
            &X,
            &GAMMA,
            &BETA,
            &[0.0, 1.0],
            &[1.0, 2.0],
            0.25,
            EPS,
            Activation::Relu,
        )
        .unwrap();
        close(&r.y, &[0.0, 0.5, 1.0, 1.5, 3.0, 0.0], 1e-15);
        assert_eq!(r.mask, Some(vec![0b011110]));
        assert_eq!(r.running_var, f.running_var);

        // Add+ReLU with z = 2, -1, 0, -2, -3, 1: pre = -1+2, 0.5-1, 1+0, 1.5-2, 3-3, -0.5+1
        //   = 1, -0.5, 1, -0.5, 0, 0.5 → y = 1, 0, 1, 0, 0, 0.5; bits 0, 2, 5 (pre = 0 at
        //   element 4 is not positive) → 0b100101.
        let z = [2.0, -1.0, 0.0, -2.0, -3.0, 1.0];
        let a = train_forward(
            &s,
            &X,
            &GAMMA,
            &BETA,
            &[0.0, 1.0],
            &[1.0, 2.0],
            0.25,
            EPS,
            Activation::AddRelu(&z),
        )
        .unwrap();
        close(&a.y, &[1.0, 0.0, 1.0, 0.0, 0.0, 0.5], 1e-15);
        assert_eq!(a.mask, Some(vec![0b100101]));
    }

    #[test]
    fn backward_hand_computed() {
        let s = BnShape::new(&[3, 2], 1).unwrap();
        let mean = [3.0, 10.0];
        let inv_std = [1.0 / 3.0, 1.0 / 3.0];
        // dy per channel: ch0 = 1, 2, 6; ch1 = 3, 0, -3.
        let dy = [1.0, 3.0, 2.0, 0.0, 6.0, -3.0];
        // No activation. M = 3.
        //   ch0: dbeta = 9, dgamma = -1*1 + 0*2 + 1*6 = 5,
        //        dx = 2 * (1/3) / 3 * (3*dy - 9 - x̂*5) = 2/9 * [3-9+5, 6-9-0, 18-9-5]
        //           = 2/9 * [-1, -3, 4] = [-2/9, -2/3, 8/9]
        //   ch1: dbeta = 0, dgamma = 0*3 + (-1)*0 + 1*(-3) = -3,
        //        dx = -1 * (1/3) / 3 * (3*dy - 0 - x̂*(-3)) = -1/9 * [9-0, 0-3, -9+3]
        //           = -1/9 * [9, -3, -6] = [-1, 1/3, 2/3]
        let g = backward(
            &s,
            &X,
            &dy,
            &GAMMA,
            &mean,
            &inv_std,
            ActivationBackward::None,
        )
        .unwrap();
        close(
            &g.dx,
            &[
                -2.0 / 9.0,
                -1.0,
                -2.0 / 3.0,
                1.0 / 3.0,
                8.0 / 9.0,
                2.0 / 3.0,
            ],
            1e-14,
        );
        close(&g.dgamma, &[5.0, -3.0], 1e-14);
        close(&g.dbeta, &[9.0, 0.0], 1e-14);
        assert!(g.d_addend.is_none());

        // ReLU with the forward's mask 0b011110: dpre = 0, 3, 2, 0, 6, 0
        //   → ch0 dpre = 0, 2, 6; ch1 dpre = 3, 0, 0.
        //   ch0: dbeta = 8, dgamma = 0 + 0 + 6 = 6,
        //        dx = 2/9 * [0-8+6, 6-8-0, 18-8-6] = 2/9 * [-2, -2, 4] = [-4/9, -4/9, 8/9]
        //   ch1: dbeta = 3, dgamma = 0*3 + (-1)*0 + 1*0 = 0,
        //        dx = -1/9 * [9-3, 0-3, 0-3] = [-2/3, 1/3, 1/3]
        let mask = [0b011110u32];
        let want_dx = [
            -4.0 / 9.0,
            -2.0 / 3.0,
            -4.0 / 9.0,
            1.0 / 3.0,
            8.0 / 9.0,
            1.0 / 3.0,
        ];
        let g = backward(
            &s,
            &X,
            &dy,
            &GAMMA,
            &mean,
            &inv_std,
            ActivationBackward::Relu { mask: &mask },
        )
        .unwrap();
        close(&g.dx, &want_dx, 1e-14);
        close(&g.dgamma, &[6.0, 0.0], 1e-14);
        close(&g.dbeta, &[8.0, 3.0], 1e-14);
        assert!(g.d_addend.is_none());
        // Add+ReLU with the same mask: same dx, and d_addend = dpre.
        let g = backward(
            &s,
            &X,
            &dy,
            &GAMMA,
            &mean,
            &inv_std,
            ActivationBackward::AddRelu { mask: &mask },
        )
        .unwrap();
        close(&g.dx, &want_dx, 1e-14);
        assert_eq!(g.d_addend, Some(vec![0.0, 3.0, 2.0, 0.0, 6.0, 0.0]));
    }

    #[test]
    fn running_statistics_update() {
        // Channels-first [2, 1, 2]: one channel, M = 4, x = 1, 2, 3, 6 → mean 3,
        // Σd² = 4 + 1 + 0 + 9 = 14, biased var 3.5, unbiased 14/3.
        let s = BnShape::new(&[2, 1, 2], 1).unwrap();
        let x = [1.0, 2.0, 3.0, 6.0];
        let run = |m: f64| {
            train_forward(
                &s,
                &x,
                &[1.0],
                &[0.0],
                &[5.0],
                &[7.0],
                m,
                1e-5,
                Activation::None,
            )
            .unwrap()
        };
        // momentum 0 keeps the running statistics; momentum 1 replaces them.
        let f = run(0.0);
        assert_eq!((f.running_mean[0], f.running_var[0]), (5.0, 7.0));
        let f = run(1.0);
        assert_eq!(f.running_mean[0], 3.0);
        close(&f.running_var, &[14.0 / 3.0], 1e-15);
        // PyTorch's default 0.1: 0.9 * 5 + 0.1 * 3 = 4.8; 0.9 * 7 + 0.1 * 14/3 = 6.7666…
        let f = run(0.1);
        close(&f.running_mean, &[4.8], 1e-15);
        close(&f.running_var, &[0.9 * 7.0 + 0.1 * 14.0 / 3.0], 1e-15);
        // Two steps compose.
        let f2 = train_forward(
            &s,
            &x,
            &[1.0],
            &[0.0],
            &f.running_mean,
            &f.running_var,
            0.1,
            1e-5,
            Activation::None,
        )
        .unwrap();
        close(&f2.running_mean, &[0.9 * 4.8 + 0.3], 1e-15);

        // The M == 1 rule: factor 1, and the biased variance of one element is 0, so the
        // running variance decays towards 0 instead of becoming NaN.
        assert_eq!(unbiased_factor(1), 1.0);
        assert_eq!(unbiased_factor(2), 2.0);
        assert_eq!(unbiased_factor(4), 4.0 / 3.0);
        let s1 = BnShape::new(&[1, 2], 1).unwrap();
        let f = train_forward(
            &s1,
            &[4.0, -2.0],
            &[1.0, 1.0],
            &[0.5, 0.0],
            &[1.0, 1.0],
            &[2.0, 3.0],
            0.5,
            1e-5,
            Activation::None,
        )
        .unwrap();
        assert_eq!(f.saved_mean, vec![4.0, -2.0]);
        assert_eq!(f.running_mean, vec![2.5, -0.5]);
        assert_eq!(f.running_var, vec![1.0, 1.5]);
        // x̂ = 0, so y = beta.
        assert_eq!(f.y, vec![0.5, 0.0]);
        close(&f.saved_inv_std, &[1.0 / 1e-5f64.sqrt(); 2], 1e-15);
    }

    /// A channels-first tensor [N, C, H, W] (axis 1) and its channels-last permutation
    /// [N, H, W, C] (axis 3) give the permuted y, mask and gradients and the same statistics —
    /// bitwise, since every sum runs in the same (n, h, w) order.
    #[test]
    fn channels_first_and_last_agree() {
        let (n, c, h, w) = (2, 3, 2, 5);
        let nchw = |ni: usize, ci: usize, hi: usize, wi: usize| ((ni * c + ci) * h + hi) * w + wi;
        let nhwc = |ni: usize, ci: usize, hi: usize, wi: usize| ((ni * h + hi) * w + wi) * c + ci;
        let to_nhwc = |v: &[f64]| {
            let mut out = vec![0.0; v.len()];
            for ni in 0..n {
                for ci in 0..c {
                    for hi in 0..h {
                        for wi in 0..w {
                            out[nhwc(ni, ci, hi, wi)] = v[nchw(ni, ci, hi, wi)];
                        }
                    }
                }
            }
            out
        };
        let mut rng = Rng(7);
        let numel = n * c * h * w;
        let x = rng.vec(numel);
        let z = rng.vec(numel);
        let dy = rng.vec(numel);
        let (gamma, beta) = (rng.vec(c), rng.vec(c));
        let (rm, rv) = (rng.vec(c), vec![1.0, 2.0, 0.5]);
        let sf = BnShape::new(&[n, c, h, w], 1).unwrap();
        let sl = BnShape::new(&[n, h, w, c], 3).unwrap();
        assert_eq!((sl.outer, sl.inner), (n * h * w, 1));
        let (xl, zl, dyl) = (to_nhwc(&x), to_nhwc(&z), to_nhwc(&dy));
        for relu in [false, true] {
            let (af, al) = if relu {
                (Activation::AddRelu(&z), Activation::AddRelu(&zl))
            } else {
                (Activation::None, Activation::None)
            };
            let ff = train_forward(&sf, &x, &gamma, &beta, &rm, &rv, 0.1, 1e-5, af).unwrap();
            let fl = train_forward(&sl, &xl, &gamma, &beta, &rm, &rv, 0.1, 1e-5, al).unwrap();
            assert_eq!(to_nhwc(&ff.y), fl.y);
            assert_eq!(ff.saved_mean, fl.saved_mean);
            assert_eq!(ff.saved_inv_std, fl.saved_inv_std);
            assert_eq!(ff.running_mean, fl.running_mean);
            assert_eq!(ff.running_var, fl.running_var);
            let (bf, bl) = match (&ff.mask, &fl.mask) {
                (Some(mf), Some(ml)) => {
                    for ni in 0..n {
                        for ci in 0..c {
                            for hi in 0..h {
                                for wi in 0..w {
                                    assert_eq!(
                                        mask_bit(mf, nchw(ni, ci, hi, wi)).unwrap(),
                                        mask_bit(ml, nhwc(ni, ci, hi, wi)).unwrap()
                                    );
                                }
                            }
                        }
                    }
                    (
                        ActivationBackward::AddRelu { mask: mf },
                        ActivationBackward::AddRelu { mask: ml },
                    )
                }
                _ => (ActivationBackward::None, ActivationBackward::None),
            };
            let gf = backward(&sf, &x, &dy, &gamma, &ff.saved_mean, &ff.saved_inv_std, bf).unwrap();
            let gl = backward(
                &sl,
                &xl,
                &dyl,
                &gamma,
                &fl.saved_mean,
                &fl.saved_inv_std,
                bl,
            )
            .unwrap();
            assert_eq!(to_nhwc(&gf.dx), gl.dx);
            assert_eq!(gf.dgamma, gl.dgamma);
            assert_eq!(gf.dbeta, gl.dbeta);
            assert_eq!(gf.d_addend.map(|d| to_nhwc(&d)), gl.d_addend);
            let yi = inference_forward(&sf, &x, &gamma, &beta, &rm, &rv, 1e-5, af).unwrap();
            let yl = inference_forward(&sl, &xl, &gamma, &beta, &rm, &rv, 1e-5, al).unwrap();
            assert_eq!(to_nhwc(&yi), yl);
        }
    }

    #[test]
    fn inference_with_batch_statistics_equals_training() {
        for (shape, axis) in [
            (&[4, 3, 5][..], 1),
            (&[6, 4][..], 1),
            (&[3, 2, 2, 5][..], 3),
        ] {
            let s = BnShape::new(shape, axis).unwrap();
            let mut rng = Rng(11 + axis as u64);
            let x: Vec<f64> = rng.vec(s.numel()).iter().map(|v| 3.0 * v + 1.0).collect();
            let z = rng.vec(s.numel());
            let (gamma, beta) = (rng.vec(s.c), rng.vec(s.c));
            let (mean, var) = batch_statistics(&s, &x).unwrap();
            for act in [Activation::None, Activation::Relu, Activation::AddRelu(&z)] {
                let t = train_forward(&s, &x, &gamma, &beta, &mean, &var, 0.1, 1e-3, act).unwrap();
                // The training forward normalises with exactly these statistics …
                assert_eq!(t.saved_mean, mean);
                let want: Vec<f64> = var.iter().map(|v| 1.0 / (v + 1e-3).sqrt()).collect();
                assert_eq!(t.saved_inv_std, want);
                // … so inference with them as running statistics gives the same y.
                let y = inference_forward(&s, &x, &gamma, &beta, &mean, &var, 1e-3, act).unwrap();
                assert_eq!(y, t.y);
            }
            // And with momentum 1 the running mean becomes the batch mean, the running
            // variance the unbiased one.
            let t = train_forward(
                &s,
                &x,
                &gamma,
                &beta,
                &mean,
                &var,
                1.0,
                1e-3,
                Activation::None,
            )
            .unwrap();
            assert_eq!(t.running_mean, mean);
            let f = unbiased_factor(s.per_channel());
            close(
                &t.running_var,
                &var.iter().map(|v| v * f).collect::<Vec<_>>(),
                1e-15,
            );
        }
    }

    #[test]
    fn inference_hand_computed() {
        // y = gamma * (x - rm) / sqrt(rv + eps) + beta with rm = [1, -1], rv = [3, 8], eps = 1:
        // ch0 inv_std = 1/2, ch1 = 1/3. x (shape [2, 2], axis 1) = [5, 2, -3, -4]:
        //   ch0: 2 * (5 - 1)/2 + 1 = 5;   2 * (-3 - 1)/2 + 1 = -3
        //   ch1: -1 * (2 + 1)/3 + 0.5 = -0.5;   -1 * (-4 + 1)/3 + 0.5 = 1.5
        let s = BnShape::new(&[2, 2], 1).unwrap();
        let x = [5.0, 2.0, -3.0, -4.0];
        let args = (&[1.0, -1.0][..], &[3.0, 8.0][..]);
        let y = inference_forward(&s, &x, &GAMMA, &BETA, args.0, args.1, 1.0, Activation::None)
            .unwrap();
        close(&y, &[5.0, -0.5, -3.0, 1.5], 1e-15);
        let y = inference_forward(&s, &x, &GAMMA, &BETA, args.0, args.1, 1.0, Activation::Relu)
            .unwrap();
        close(&y, &[5.0, 0.0, 0.0, 1.5], 1e-15);
        let z = [-6.0, 1.0, 4.0, -2.0];
        let y = inference_forward(
            &s,
            &x,
            &GAMMA,
            &BETA,
            args.0,
            args.1,
            1.0,
            Activation::AddRelu(&z),
        )
        .unwrap();
        close(&y, &[0.0, 0.5, 1.0, 0.0], 1e-15);
    }

    /// Which activation a finite-difference case uses.
    #[derive(Clone, Copy, Debug)]
    enum Act {
        None,
        Relu,
        AddRelu,
    }

    /// Finite-difference check of the backward: for the loss `L = Σ w · y` the analytic
    /// gradients (backward with `dy = w`) must match central differences
    /// `(L(p + h v) - L(p - h v)) / 2h` along random directions `v`, separately for x, gamma,
    /// beta and the addend, to a relative 1e-6. The data are drawn until every pre-activation
    /// is at least 1e-2 away from the ReLU kink, so that the ±h perturbations (h = 1e-6) never
    /// cross it.
    fn finite_difference_case(shape: &[usize], axis: usize, act: Act, seed: u64) {
        let s = BnShape::new(shape, axis).unwrap();
        let eps = 1e-5;
        let mut rng = Rng(seed);
        let (x, z, gamma, beta) = loop {
            let x: Vec<f64> = rng.vec(s.numel()).iter().map(|v| 2.0 * v + 0.5).collect();
            let z = rng.vec(s.numel());
            let gamma: Vec<f64> = rng.vec(s.c).iter().map(|v| v + 1.5).collect();
            let beta = rng.vec(s.c);
            let pre = match act {
                Act::None => break (x, z, gamma, beta),
                Act::Relu => {
                    train_forward(
                        &s,
                        &x,
                        &gamma,
                        &beta,
                        &beta,
                        &gamma,
                        0.0,
                        eps,
                        Activation::None,
                    )
                    .unwrap()
                    .y
                }
                Act::AddRelu => {
                    let y = train_forward(
                        &s,
                        &x,
                        &gamma,
                        &beta,
                        &beta,
                        &gamma,
                        0.0,
                        eps,
                        Activation::None,
                    )
                    .unwrap()
                    .y;
                    y.iter().zip(&z).map(|(a, b)| a + b).collect()
                }
            };
            let positive = pre.iter().filter(|v| **v > 0.0).count();
            if pre.iter().all(|v| v.abs() > 1e-2) && positive > 0 && positive < pre.len() {
                break (x, z, gamma, beta);
            }
        };
        let w = rng.vec(s.numel());
        let ones = vec![1.0; s.c];
        let fwd = |x: &[f64], gamma: &[f64], beta: &[f64], z: &[f64]| {
            let a = match act {
                Act::None => Activation::None,
                Act::Relu => Activation::Relu,
                Act::AddRelu => Activation::AddRelu(z),
            };
            train_forward(&s, x, gamma, beta, &ones, &ones, 0.1, eps, a).unwrap()
        };
        let loss = |x: &[f64], gamma: &[f64], beta: &[f64], z: &[f64]| -> f64 {
            fwd(x, gamma, beta, z)
                .y
                .iter()
                .zip(&w)
                .map(|(a, b)| a * b)
                .sum()
        };
        let f = fwd(&x, &gamma, &beta, &z);
        let mask = f.mask.clone().unwrap_or_default();
        let ab = match act {
            Act::None => ActivationBackward::None,
            Act::Relu => ActivationBackward::Relu { mask: &mask },
            Act::AddRelu => ActivationBackward::AddRelu { mask: &mask },
        };
        let g = backward(&s, &x, &w, &gamma, &f.saved_mean, &f.saved_inv_std, ab).unwrap();
        let h = 1e-6;
        let shifted = |p: &[f64], v: &[f64], t: f64| -> Vec<f64> {
            p.iter().zip(v).map(|(a, b)| a + t * b).collect()
        };
        let dot = |a: &[f64], b: &[f64]| -> f64 { a.iter().zip(b).map(|(p, q)| p * q).sum() };
        let check = |what: &str, analytic: f64, numeric: f64| {
            let err = (analytic - numeric).abs();
            assert!(
                err <= 1e-6 * analytic.abs().max(1e-3),
                "{what} ({act:?}, {shape:?} axis {axis}): analytic {analytic}, numeric {numeric}"
            );
        };
        // x
        let v = rng.vec(s.numel());
        let num = (loss(&shifted(&x, &v, h), &gamma, &beta, &z)
            - loss(&shifted(&x, &v, -h), &gamma, &beta, &z))
            / (2.0 * h);
        check("dx", dot(&g.dx, &v), num);
        // gamma
        let v = rng.vec(s.c);
        let num = (loss(&x, &shifted(&gamma, &v, h), &beta, &z)
            - loss(&x, &shifted(&gamma, &v, -h), &beta, &z))
            / (2.0 * h);
        check("dgamma", dot(&g.dgamma, &v), num);
        // beta
        let v = rng.vec(s.c);
        let num = (loss(&x, &gamma, &shifted(&beta, &v, h), &z)
            - loss(&x, &gamma, &shifted(&beta, &v, -h), &z))
            / (2.0 * h);
        check("dbeta", dot(&g.dbeta, &v), num);
        // addend
        if let Act::AddRelu = act {
            let v = rng.vec(s.numel());
            let num = (loss(&x, &gamma, &beta, &shifted(&z, &v, h))
                - loss(&x, &gamma, &beta, &shifted(&z, &v, -h)))
                / (2.0 * h);
            let d_addend = g.d_addend.as_deref().unwrap();
            check("d_addend", dot(d_addend, &v), num);
        } else {
            assert!(g.d_addend.is_none());
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        let cases: [(&[usize], usize); 4] = [
            (&[2, 3, 5], 1),    // channels-first
            (&[4, 2, 3], 2),    // channels-last (inner = 1)
            (&[3, 4], 0),       // axis 0, inner 4
            (&[2, 2, 3, 2], 1), // 4-D NCHW
        ];
        for (k, (shape, axis)) in cases.into_iter().enumerate() {
            for act in [Act::None, Act::Relu, Act::AddRelu] {
                finite_difference_case(shape, axis, act, 1234 + k as u64);
            }
        }
    }
}
