//! The correctness check of one training step, operation by operation: every output is compared
//! with an f64 reference computed from **that operation's own inputs as the GPU left them**
//! (so that one operation's rounding does not count against the next, and a ReLU's kink cannot
//! flip between the GPU and the reference), which also checks the wiring: each reference reads
//! the buffers the block definition says the operation reads. Pure: no GPU.

use nnfuse::reference::batchnorm::{self as bnref, Activation, ActivationBackward, BnShape};

use super::block::{BlockDef, Op, EPS, MOMENTUM, STEP};
use super::reference::{
    compare, conv_backward_data, conv_backward_filter, conv_forward, fc_feature_grad, fc_forward,
    fc_weight_grad, mask_of_output, Compared,
};

/// What one step reads, widened to f64: the caller's tensors.
#[derive(Debug, Clone, Default)]
pub struct StepInputs {
    /// The block's input (also the shortcut).
    pub x: Vec<f64>,
    /// The three filters.
    pub w: [Vec<f64>; 3],
    /// BatchNorm scales.
    pub gamma: [Vec<f64>; 3],
    /// BatchNorm biases.
    pub beta: [Vec<f64>; 3],
    /// Running means before the step.
    pub running_mean: [Vec<f64>; 3],
    /// Running variances before the step.
    pub running_var: [Vec<f64>; 3],
    /// The gradient arriving at the block's output.
    pub dout: Vec<f64>,
    /// Classifier features `[n][fc_in]`.
    pub feat: Vec<f64>,
    /// Classifier weight `[fc_out][fc_in]`.
    pub fc_w: Vec<f64>,
    /// The gradient arriving at the logits `[n][fc_out]`.
    pub dlogits: Vec<f64>,
}

/// What one step wrote, widened to f64.
#[derive(Debug, Clone, Default)]
pub struct StepOutputs {
    /// Convolution outputs.
    pub a: [Vec<f64>; 3],
    /// BatchNorm(+activation) outputs; `h[2]` is the block's output.
    pub h: [Vec<f64>; 3],
    /// Running means after the step.
    pub running_mean: [Vec<f64>; 3],
    /// Running variances after the step.
    pub running_var: [Vec<f64>; 3],
    /// Gradients of the convolution outputs (BatchNorm backward).
    pub da: [Vec<f64>; 3],
    /// Gradients of `h[0]` and `h[1]` (data gradients of convolutions 2 and 3).
    pub dh: [Vec<f64>; 2],
    /// Convolution 1's data gradient.
    pub dx_conv: Vec<f64>,
    /// The block input's gradient (shortcut plus convolution 1's).
    pub dx: Vec<f64>,
    /// Filter gradients.
    pub dw: [Vec<f64>; 3],
    /// BatchNorm scale gradients.
    pub dgamma: [Vec<f64>; 3],
    /// BatchNorm bias gradients.
    pub dbeta: [Vec<f64>; 3],
    /// Classifier logits.
    pub logits: Vec<f64>,
    /// Classifier weight gradient.
    pub fc_dw: Vec<f64>,
    /// Classifier feature gradient.
    pub dfeat: Vec<f64>,
}

/// Fresh random inputs for `def` (uniform: activations, filters and gradients in [-1, 1),
/// scales in [0.5, 1.5), biases and running means in [-0.5, 0.5), running variances in
/// [0.5, 1.5)), each value already rounded as the GPU will hold it: `round` for the element
/// type, f32 for BatchNorm's parameters. Never zeros. Errors: a filter's element count overflows
/// usize (named `w`).
pub fn random_inputs(
    def: &BlockDef,
    seed: u64,
    round: &dyn Fn(f64) -> f64,
) -> nnfuse::Result<StepInputs> {
    let mut state = seed ^ 0x9E37_79B9_7F4A_7C15;
    let mut next = move |lo: f64, hi: f64| -> f64 {
        // SplitMix64.
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        lo + (hi - lo) * ((z >> 11) as f64 / (1u64 << 53) as f64)
    };
    let f32r = |v: f64| v as f32 as f64;
    let mut data = |n: usize| -> Vec<f64> { (0..n).map(|_| round(next(-1.0, 1.0))).collect() };
    let x = data(def.act_len(def.c));
    let w_lens = [
        def.conv(0).w_len()?,
        def.conv(1).w_len()?,
        def.conv(2).w_len()?,
    ];
    let w = w_lens.map(&mut data);
    let dout = data(def.act_len(def.c));
    let feat = data(def.n * def.fc_in);
    let fc_w = data(def.fc_out * def.fc_in);
    let dlogits = data(def.n * def.fc_out);
    let mut param = |i: usize, lo: f64, hi: f64| -> Vec<f64> {
        (0..def.bn_channels(i))
            .map(|_| f32r(next(lo, hi)))
            .collect()
    };
    let gamma = [0, 1, 2].map(|i| param(i, 0.5, 1.5));
    let beta = [0, 1, 2].map(|i| param(i, -0.5, 0.5));
    let running_mean = [0, 1, 2].map(|i| param(i, -0.5, 0.5));
    let running_var = [0, 1, 2].map(|i| param(i, 0.5, 1.5));
    Ok(StepInputs {
        x,
        w,
        gamma,
        beta,
        running_mean,
        running_var,
        dout,
        feat,
        fc_w,
        dlogits,
    })
}

/// The tolerance of `op`'s outputs against f64 for `dtype` when its convolution ran `route`:
/// a Winograd route is held to the dispatcher's own check tolerance
/// (`nnfuse::internals::conv::check_tolerance`: f32 1e-4, f16 1e-2, bf16 2e-2; its transforms amplify
/// rounding, docs/CONV.md), everything else to `DType::tolerance` (f32 1e-5, halves 1e-2) —
/// the rule of the library's GPU tests.
pub fn tolerance(op: Op, dtype: nnfuse::DType, route: Option<nnfuse::conv::Route>) -> f64 {
    match (op.conv(), route) {
        (Some(_), Some(r)) if r.path.winograd_tile().is_some() => {
            nnfuse::internals::conv::check_tolerance(dtype)
        }
        _ => dtype.tolerance(),
    }
}

/// One compared quantity.
#[derive(Debug, Clone)]
pub struct Row {
    /// The operation that wrote it.
    pub op: Op,
    /// Which of its outputs (`y`, `dx`, `dw`, `dgamma`, `running_var`, ...).
    pub quantity: &'static str,
    /// The comparison with the reference.
    pub compared: Compared,
    /// The tolerance it is held to.
    pub tol: f64,
}

impl Row {
    /// Whether it passed.
    pub fn ok(&self) -> bool {
        self.compared.within(self.tol)
    }

    /// `bn2.bwd dgamma`.
    pub fn label(&self) -> String {
        format!("{} {}", self.op.name(), self.quantity)
    }
}

fn bn_shape(def: &BlockDef, i: usize) -> BnShape {
    let (shape, axis) = def.bn_shape(i);
    BnShape::new(&shape, axis).expect("the demo's BatchNorm shapes are valid")
}

/// The input of convolution `i` (the block's input, else the previous BatchNorm's output).
fn conv_input<'a>(inp: &'a StepInputs, out: &'a StepOutputs, i: usize) -> &'a [f64] {
    if i == 0 {
        &inp.x
    } else {
        &out.h[i - 1]
    }
}

/// The rows of the block's step (every op of [`STEP`] but the classifier's) and of the
/// classifier's GEMMs, in step order; `tol(op)` is the tolerance of each op.
///
/// `dx_in_place`: `conv1.dgrad` added its gradient into dx (which held the shortcut's), so its
/// row is dx against the shortcut's gradient plus the data gradient, and `dx.add` has none.
pub fn check_step(
    def: &BlockDef,
    inp: &StepInputs,
    out: &StepOutputs,
    tol: &dyn Fn(Op) -> f64,
    dx_in_place: bool,
    folded: [bool; 3],
) -> nnfuse::Result<Vec<Row>> {
    let mut rows = Vec::new();
    // A folded unit backward writes no BatchNorm input gradient: its convolution gradients are
    // checked against the f64 chain (the reference BatchNorm backward, then the convolution's).
    let mut dz_ref: [Option<Vec<f64>>; 3] = [None, None, None];
    let mut push = |op: Op, quantity: &'static str, got: &[f64], want: &[f64]| {
        rows.push(Row {
            op,
            quantity,
            compared: compare(got, want),
            tol: tol(op),
        });
    };
    // BatchNorm references: forward from the GPU's conv output, backward from the GPU's
    // incoming gradient with the mask of the GPU's own output.
    let mut bn_fwd: Vec<Option<bnref::BnForward>> = vec![None, None, None];
    let mut d_shortcut: Option<Vec<f64>> = None;
    for op in STEP {
        match op {
            Op::ConvFwd(i) => {
                let want = conv_forward(&def.conv(i), conv_input(inp, out, i), &inp.w[i]);
                push(op, "y", &out.a[i], &want);
            }
            Op::BnFwd(i) => {
                let s = bn_shape(def, i);
                let act = if i == 2 {
                    Activation::AddRelu(&inp.x)
                } else {
                    Activation::Relu
                };
                let f = bnref::train_forward(
                    &s,
                    &out.a[i],
                    &inp.gamma[i],
                    &inp.beta[i],
                    &inp.running_mean[i],
                    &inp.running_var[i],
                    MOMENTUM,
                    EPS,
                    act,
                )?;
                push(op, "y", &out.h[i], &f.y);
                push(op, "running_mean", &out.running_mean[i], &f.running_mean);
                push(op, "running_var", &out.running_var[i], &f.running_var);
                bn_fwd[i] = Some(f);
            }
            Op::BnBwd(i) => {
                let Some(f) = &bn_fwd[i] else {
                    continue;
                };
                let s = bn_shape(def, i);
                let mask = mask_of_output(&out.h[i]);
                let (dy, act) = if i == 2 {
                    (&inp.dout, ActivationBackward::AddRelu { mask: &mask })
                } else {
                    (&out.dh[i], ActivationBackward::Relu { mask: &mask })
                };
                let g = bnref::backward(
                    &s,
                    &out.a[i],
                    dy,
                    &inp.gamma[i],
                    &f.saved_mean,
                    &f.saved_inv_std,
                    act,
                )?;
                if !folded[i] {
                    push(op, "dx", &out.da[i], &g.dx);
                }
                push(op, "dgamma", &out.dgamma[i], &g.dgamma);
                push(op, "dbeta", &out.dbeta[i], &g.dbeta);
                if i == 2 {
                    d_shortcut = g.d_addend;
                }
                if folded[i] {
                    dz_ref[i] = Some(g.dx);
                }
            }
            Op::ConvDgrad(i) => {
                let da = dz_ref[i].as_deref().unwrap_or(&out.da[i]);
                let want = conv_backward_data(&def.conv(i), da, &inp.w[i]);
                match (&d_shortcut, i == 0 && dx_in_place) {
                    (Some(ds), true) => {
                        let want: Vec<f64> = ds.iter().zip(&want).map(|(a, b)| a + b).collect();
                        push(op, "dx (block input)", &out.dx, &want);
                    }
                    (None, true) => {}
                    (_, false) => {
                        let got = if i == 0 { &out.dx_conv } else { &out.dh[i - 1] };
                        push(op, "dx", got, &want);
                    }
                }
            }
            Op::ConvWgrad(i) => {
                let da = dz_ref[i].as_deref().unwrap_or(&out.da[i]);
                let want = conv_backward_filter(&def.conv(i), conv_input(inp, out, i), da);
                push(op, "dw", &out.dw[i], &want);
            }
            Op::AddDx if dx_in_place => {}
            Op::AddDx => {
                if let Some(ds) = &d_shortcut {
                    let want: Vec<f64> = ds.iter().zip(&out.dx_conv).map(|(a, b)| a + b).collect();
                    push(op, "dx (block input)", &out.dx, &want);
                }
            }
            Op::FcFwd => {
                let want = fc_forward(def.n, def.fc_in, def.fc_out, &inp.feat, &inp.fc_w);
                push(op, "logits", &out.logits, &want);
            }
            Op::FcWgrad => {
                let want = fc_weight_grad(def.n, def.fc_in, def.fc_out, &inp.feat, &inp.dlogits);
                push(op, "dw", &out.fc_dw, &want);
            }
            Op::FcDgrad => {
                let want = fc_feature_grad(def.n, def.fc_in, def.fc_out, &inp.fc_w, &inp.dlogits);
                push(op, "dx", &out.dfeat, &want);
            }
        }
    }
    Ok(rows)
}

/// The rows of the classifier's three GEMMs alone (the check at the timed batch).
pub fn check_classifier(
    def: &BlockDef,
    inp: &StepInputs,
    out: &StepOutputs,
    tol: &dyn Fn(Op) -> f64,
) -> Vec<Row> {
    let fc = |op: Op, quantity: &'static str, got: &[f64], want: Vec<f64>| Row {
        op,
        quantity,
        compared: compare(got, &want),
        tol: tol(op),
    };
    let (n, fin, fout) = (def.n, def.fc_in, def.fc_out);
    vec![
        fc(
            Op::FcFwd,
            "logits",
            &out.logits,
            fc_forward(n, fin, fout, &inp.feat, &inp.fc_w),
        ),
        fc(
            Op::FcWgrad,
            "dw",
            &out.fc_dw,
            fc_weight_grad(n, fin, fout, &inp.feat, &inp.dlogits),
        ),
        fc(
            Op::FcDgrad,
            "dx",
            &out.dfeat,
            fc_feature_grad(n, fin, fout, &inp.fc_w, &inp.dlogits),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use nnfuse::{DType, TensorFormat};

    use super::super::test_values as values;

    fn tiny(format: TensorFormat) -> BlockDef {
        BlockDef {
            n: 2,
            c: 8,
            mid: 4,
            hw: 5,
            format,
            dtype: DType::F32,
            fc_in: 6,
            fc_out: 5,
        }
    }

    fn inputs(def: &BlockDef) -> StepInputs {
        let ch = |i: usize| def.bn_channels(i);
        StepInputs {
            x: values(1, def.act_len(def.c), -1.0, 1.0),
            w: [0, 1, 2].map(|i| values(10 + i as u64, def.conv(i).w_len().unwrap(), -1.0, 1.0)),
            gamma: [0, 1, 2].map(|i| values(20 + i as u64, ch(i), 0.5, 1.5)),
            beta: [0, 1, 2].map(|i| values(30 + i as u64, ch(i), -0.5, 0.5)),
            running_mean: [0, 1, 2].map(|i| values(40 + i as u64, ch(i), -0.5, 0.5)),
            running_var: [0, 1, 2].map(|i| values(50 + i as u64, ch(i), 0.5, 1.5)),
            dout: values(2, def.act_len(def.c), -1.0, 1.0),
            feat: values(3, def.n * def.fc_in, -1.0, 1.0),
            fc_w: values(4, def.fc_out * def.fc_in, -1.0, 1.0),
            dlogits: values(5, def.n * def.fc_out, -1.0, 1.0),
        }
    }

    /// The block's training step in f64 from the references, wired as the GPU step is.
    fn cpu_step(def: &BlockDef, inp: &StepInputs) -> StepOutputs {
        let mut o = StepOutputs::default();
        let mut saved = Vec::new();
        for i in 0..3 {
            let input = if i == 0 {
                inp.x.clone()
            } else {
                o.h[i - 1].clone()
            };
            o.a[i] = conv_forward(&def.conv(i), &input, &inp.w[i]);
            let act = if i == 2 {
                Activation::AddRelu(&inp.x)
            } else {
                Activation::Relu
            };
            let f = bnref::train_forward(
                &bn_shape(def, i),
                &o.a[i],
                &inp.gamma[i],
                &inp.beta[i],
                &inp.running_mean[i],
                &inp.running_var[i],
                MOMENTUM,
                EPS,
                act,
            )
            .unwrap();
            o.h[i] = f.y.clone();
            o.running_mean[i] = f.running_mean.clone();
            o.running_var[i] = f.running_var.clone();
            saved.push(f);
        }
        let mut dy = inp.dout.clone();
        let mut shortcut = Vec::new();
        for i in (0..3).rev() {
            let mask = saved[i].mask.clone().unwrap();
            let act = if i == 2 {
                ActivationBackward::AddRelu { mask: &mask }
            } else {
                ActivationBackward::Relu { mask: &mask }
            };
            let g = bnref::backward(
                &bn_shape(def, i),
                &o.a[i],
                &dy,
                &inp.gamma[i],
                &saved[i].saved_mean,
                &saved[i].saved_inv_std,
                act,
            )
            .unwrap();
            if i == 2 {
                shortcut = g.d_addend.clone().unwrap();
            }
            o.da[i] = g.dx;
            o.dgamma[i] = g.dgamma;
            o.dbeta[i] = g.dbeta;
            let input = if i == 0 {
                inp.x.clone()
            } else {
                o.h[i - 1].clone()
            };
            o.dw[i] = conv_backward_filter(&def.conv(i), &input, &o.da[i]);
            dy = conv_backward_data(&def.conv(i), &o.da[i], &inp.w[i]);
            if i > 0 {
                o.dh[i - 1] = dy.clone();
            }
        }
        o.dx_conv = dy;
        o.dx = shortcut
            .iter()
            .zip(&o.dx_conv)
            .map(|(a, b)| a + b)
            .collect();
        o.logits = fc_forward(def.n, def.fc_in, def.fc_out, &inp.feat, &inp.fc_w);
        o.fc_dw = fc_weight_grad(def.n, def.fc_in, def.fc_out, &inp.feat, &inp.dlogits);
        o.dfeat = fc_feature_grad(def.n, def.fc_in, def.fc_out, &inp.fc_w, &inp.dlogits);
        o
    }

    #[test]
    fn an_exact_step_passes_with_every_quantity_checked() {
        for format in [TensorFormat::Nhwc, TensorFormat::Nchw] {
            let def = tiny(format);
            let inp = inputs(&def);
            let out = cpu_step(&def, &inp);
            let rows = check_step(&def, &inp, &out, &|_| 1e-12, false, [false; 3]).unwrap();
            // 3 conv fwd + 3 BN fwd (3 each) + 3 BN bwd (3 each) + 3 dgrad + 3 wgrad + dx + 3 fc.
            assert_eq!(rows.len(), 3 + 9 + 9 + 3 + 3 + 1 + 3, "{format}");
            for r in &rows {
                assert!(r.ok(), "{format} {}: {:?}", r.label(), r.compared);
                assert!(r.compared.len > 0);
            }
            let fc = check_classifier(&def, &inp, &out, &|_| 1e-12);
            assert_eq!(fc.len(), 3);
            assert!(fc.iter().all(Row::ok));
        }
    }

    /// A wrong element anywhere, or a buffer wired to the wrong place, fails the row of the
    /// operation that wrote it (and only rows that read it as their own output).
    #[test]
    fn a_wrong_output_or_wiring_is_caught_where_it_happens() {
        let def = tiny(TensorFormat::Nhwc);
        let inp = inputs(&def);
        let good = cpu_step(&def, &inp);
        let failing = |out: &StepOutputs| -> Vec<String> {
            check_step(&def, &inp, out, &|_| 1e-9, false, [false; 3])
                .unwrap()
                .iter()
                .filter(|r| !r.ok())
                .map(Row::label)
                .collect()
        };
        let mut bad = good.clone();
        bad.dw[1][3] += 0.1;
        assert_eq!(failing(&bad), ["conv2.wgrad dw"]);
        let mut bad = good.clone();
        bad.dx[7] = f64::NAN;
        assert_eq!(failing(&bad), ["dx.add dx (block input)"]);
        let mut bad = good.clone();
        bad.dgamma[2][0] *= 1.5;
        assert_eq!(failing(&bad), ["bn3.bwd dgamma"]);
        let mut bad = good.clone();
        bad.running_var[0][1] += 0.01;
        assert_eq!(failing(&bad), ["bn1.fwd running_var"]);
        let mut bad = good.clone();
        bad.fc_dw[0] += 1.0;
        assert_eq!(failing(&bad), ["fc.wgrad dw"]);
        // Convolution 2's output computed from x's first channels instead of h1: its own row
        // fails.
        let mut bad = good.clone();
        bad.a[1] = conv_forward(&def.conv(1), &inp.x[..def.act_len(def.mid)], &inp.w[1]);
        assert!(
            failing(&bad).contains(&"conv2.fwd y".to_string()),
            "{:?}",
            failing(&bad)
        );
        // The shortcut's gradient left out of dx.
        let mut bad = good.clone();
        bad.dx = bad.dx_conv.clone();
        assert_eq!(failing(&bad), ["dx.add dx (block input)"]);
    }

    #[test]
    fn random_inputs_are_rounded_and_never_zero() {
        let def = tiny(TensorFormat::Nhwc);
        let r = |v: f64| half::f16::from_f64(v).to_f64();
        let a = random_inputs(&def, 7, &r).unwrap();
        let b = random_inputs(&def, 8, &r).unwrap();
        assert_ne!(a.x, b.x);
        assert_eq!(a.x.len(), def.act_len(def.c));
        assert_eq!(a.w[1].len(), def.conv(1).w_len().unwrap());
        assert!(a.x.iter().all(|&v| v == r(v) && (-1.0..=1.0).contains(&v)));
        assert!(a.x.iter().filter(|&&v| v != 0.0).count() > a.x.len() * 9 / 10);
        assert!(a.gamma[2]
            .iter()
            .all(|&g| (0.5..1.5).contains(&g) && g == g as f32 as f64));
        assert!(a.running_var[0].iter().all(|&v| v >= 0.5));
    }

    #[test]
    fn winograd_routes_get_the_dispatchers_tolerance() {
        use nnfuse::conv::{ConvPath, Route, WinogradEngine, WinogradTile};
        let wino = Route::winograd(WinogradTile::F4x3, WinogradEngine::TensorCore);
        assert_eq!(tolerance(Op::ConvFwd(1), DType::F32, Some(wino)), 1e-4);
        assert_eq!(
            tolerance(
                Op::ConvFwd(1),
                DType::F32,
                Some(Route::path(ConvPath::Im2colGemm))
            ),
            1e-5
        );
        assert_eq!(tolerance(Op::BnFwd(1), DType::BF16, Some(wino)), 1e-2);
        assert_eq!(tolerance(Op::ConvDgrad(1), DType::BF16, Some(wino)), 2e-2);
        assert_eq!(tolerance(Op::FcFwd, DType::F32, None), 1e-5);
    }

    #[test]
    fn a_folded_unit_is_checked_through_the_f64_chain() {
        let def = tiny(TensorFormat::Nhwc);
        let inp = inputs(&def);
        let mut out = cpu_step(&def, &inp);
        // A folded backward writes no BatchNorm input gradient: the rows must not read it.
        out.da[2].iter_mut().for_each(|v| *v = f64::NAN);
        let rows = check_step(&def, &inp, &out, &|_| 1e-9, false, [false, false, true]).unwrap();
        assert!(rows.iter().all(|r| r.ok()), "{rows:?}");
        assert!(!rows
            .iter()
            .any(|r| r.op == Op::BnBwd(2) && r.quantity == "dx"));
        assert!(rows.iter().any(|r| r.op == Op::ConvWgrad(2)));
        // Not folded, the poisoned dz fails its own row and the convolutions' that read it.
        let rows = check_step(&def, &inp, &out, &|_| 1e-9, false, [false; 3]).unwrap();
        assert!(rows.iter().any(|r| !r.ok()));
        // And a wrong folded filter gradient is caught.
        out.dw[2][0] += 1.0;
        let rows = check_step(&def, &inp, &out, &|_| 1e-9, false, [false, false, true]).unwrap();
        assert!(rows.iter().any(|r| r.op == Op::ConvWgrad(2) && !r.ok()));
    }

    #[test]
    fn tolerances_come_from_the_caller_per_op() {
        let def = tiny(TensorFormat::Nchw);
        let inp = inputs(&def);
        let mut out = cpu_step(&def, &inp);
        out.a[0][0] += 1e-3;
        let rows = check_step(
            &def,
            &inp,
            &out,
            &|op| {
                if op == Op::ConvFwd(0) {
                    1.0
                } else {
                    1e-12
                }
            },
            false,
            [false; 3],
        )
        .unwrap();
        let r = rows.iter().find(|r| r.op == Op::ConvFwd(0)).unwrap();
        assert_eq!(r.tol, 1.0);
        assert!(r.ok());
    }

    /// With dx added in place (nnfuse's composition), conv1.dgrad's row is the block input's
    /// dx against the shortcut's gradient plus the data gradient, and dx.add has no row; a wrong
    /// dx still fails there.
    #[test]
    fn an_in_place_dx_is_checked_at_conv1_dgrad() {
        let def = tiny(TensorFormat::Nchw);
        let inp = inputs(&def);
        let out = cpu_step(&def, &inp);
        let rows = check_step(&def, &inp, &out, &|_| 1e-12, true, [false; 3]).unwrap();
        assert!(rows.iter().all(|r| r.ok()));
        assert!(rows.iter().all(|r| r.op != Op::AddDx));
        let r = rows.iter().find(|r| r.op == Op::ConvDgrad(0)).unwrap();
        assert_eq!(r.quantity, "dx (block input)");
        let mut bad = out.clone();
        bad.dx = bad.dx_conv.clone();
        let rows = check_step(&def, &inp, &bad, &|_| 1e-9, true, [false; 3]).unwrap();
        let failing: Vec<_> = rows.iter().filter(|r| !r.ok()).map(|r| r.op).collect();
        assert_eq!(failing, [Op::ConvDgrad(0)]);
    }
}
