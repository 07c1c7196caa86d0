//! GPU probes of cuDNN's runtime-fusion patterns for a fused training block
//! (docs/BLOCK-TRAINING.md §2 and §5): ConvBNfprop (conv → GEN_STATS, with and without the
//! scale-bias-ReLU prologue), BN finalize, ConvBNwgrad, DgradDreluBNBwdWeight, the data gradient
//! with beta = 1, a re-probe of nnfuse's BatchNorm ReLU / Add+ReLU epilogue graphs, and the
//! epilogue in cudnn-frontend's mask form (`probe_bn_relu_mask`: the forward writing a BOOLEAN
//! ReLU mask with CMP_GT, the backward reading it with MUL before NORM_BACKWARD).
//!
//! Each probe builds the pattern at the demo's shapes (N = 4, 56x56, C = 64 / 256; finalize
//! only) and at a small shape (N = 2, 8x8), for f16, bf16 and f32 I/O; prints the heuristics'
//! config counts and every tried config's finalize status (engine, knobs, notes, cuDNN's
//! message, finalize time); and, where a plan finalized at the small shape, runs it once on
//! fresh random inputs (outputs NaN-poisoned) against an f64 reference. A pattern cuDNN refuses
//! prints `NOT SUPPORTED: <reason>` and passes; a wrong result of a pattern that ran fails.
//!
//! Run (the lead): `cargo test --test gpu_fusion_probe -- --ignored --nocapture --test-threads 1`
//! and grep the lines starting with `PROBE `.

mod common;

use std::collections::HashMap;

use cudarc::driver::{CudaSlice, DevicePtrMut};
use half::{bf16, f16};
use nnfuse::conv::ConvShape;
use nnfuse::internals::cudnn_graph::{
    available, bn_epilogue, bn_finalize, bn_mask_backward, dgrad_accumulate,
    dgrad_drelu_dbn_weight, fusion_execute, fusion_variant_pack, search_plans, wgrad_prologue,
    BnDirection, BnEpilogue, BnGraphParts, BnMaskForward, ConvGenStats, ElemType, FusionGraph,
    GraphBnKey, MaskComparand, MaskSource, PlanSearch, Prologue, ReluAttrs,
};
use nnfuse::reference::conv::{conv2d, conv2d_backward_data, conv2d_backward_filter};
use nnfuse::{ChannelLayout, Context, DType, Element, Error, TensorFormat};

use common::{download, f64s, poisoned, rel_l2, upload, Rng};

/// Plans finalized per graph at most (each may compile an engine: about 1.5 s).
const MAX_PLANS: usize = 2;

fn gpu() -> Option<Context> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("nnfuse=error")),
        )
        .with_test_writer()
        .try_init();
    let must = ["GPU_STAGE_RUN", "NNFUSE_GPU_RUN"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|s| s == "1"));
    let ctx = if nnfuse::context::driver_present() {
        Context::with_config(0, nnfuse::Config::default())
    } else {
        Err(Error::NoDevice("no CUDA driver".into()))
    };
    match (ctx, available()) {
        (Ok(c), Ok(v)) => {
            println!("cuDNN {v}, {}", c.info());
            Some(c)
        }
        (Err(e), _) | (_, Err(e)) if must => panic!("the probe needs a GPU and cuDNN 9: {e}"),
        (Err(e), _) | (_, Err(e)) => {
            println!("skipped: {e}");
            None
        }
    }
}

fn nhwc(n: usize, c: usize, hw: usize, k: usize, r: usize) -> ConvShape {
    ConvShape::square(n, c, hw, k, r, TensorFormat::Nhwc)
}

fn label(s: &ConvShape) -> String {
    format!(
        "n{} {}x{} c{}->{} {}x{}",
        s.n, s.h, s.w, s.c_in, s.c_out, s.kh, s.kw
    )
}

/// Prints `search` (counts, every attempt) under `title`.
fn print_search(title: &str, s: &PlanSearch) {
    println!(
        "  {title}: heuristics INSTANT {:?}, FALLBACK {:?}; {} distinct configs",
        s.instant, s.fallback, s.listed
    );
    for (i, a) in s.attempts.iter().enumerate() {
        match &a.outcome {
            Ok(ws) => println!(
                "    [{i}] {} -> FINALIZED, workspace {ws} B, {:.1} ms",
                a.info, a.finalize_ms
            ),
            Err(m) => println!(
                "    [{i}] {} -> FAILED {:.1} ms: {m}",
                a.info, a.finalize_ms
            ),
        }
    }
}

/// The summary of one probe: `PROBE <pattern> <dtype> <shape>: ...`.
fn summary(pattern: &str, dt: DType, shape: &str, s: &PlanSearch, ran: Option<f64>) -> String {
    let eng = s
        .plan
        .as_ref()
        .map_or("none".to_string(), |(i, _)| i.label());
    let err = ran.map_or("not run".to_string(), |e| format!("{e:.3e}"));
    format!(
        "PROBE {pattern} {} {shape}: finalized {} of {} configs tried ({} listed); ran {eng}; max rel err {err}",
        dt.name(),
        s.finalized(),
        s.attempts.len(),
        s.listed
    )
}

/// Host inputs and device buffers of one execution, by tensor name: data of type `T`,
/// per-channel f32 vectors, and by-value scalars (host addresses, kept alive by the caller).
struct Io<T: Element> {
    data: HashMap<&'static str, CudaSlice<T>>,
    stats: HashMap<&'static str, CudaSlice<f32>>,
    /// Byte tensors (cuDNN's BOOLEAN masks).
    bytes: HashMap<&'static str, CudaSlice<u8>>,
    scalars: HashMap<&'static str, u64>,
}

impl<T: Element> Io<T> {
    fn new() -> Self {
        Io {
            data: HashMap::new(),
            stats: HashMap::new(),
            bytes: HashMap::new(),
            scalars: HashMap::new(),
        }
    }
    fn bytes_in(&mut self, ctx: &Context, name: &'static str, v: &[u8]) {
        self.bytes.insert(name, ctx.stream().clone_htod(v).unwrap());
    }
    /// `n` bytes of poison 0x5A: neither a 0/1 byte nor all-equal bits, so an unwritten
    /// byte fails either mask layout.
    fn bytes_out(&mut self, ctx: &Context, name: &'static str, n: usize) {
        self.bytes_in(ctx, name, &vec![0x5A; n]);
    }
    fn get_bytes(&self, ctx: &Context, name: &str) -> Vec<u8> {
        let b = self
            .bytes
            .get(name)
            .unwrap_or_else(|| panic!("no buffer {name}"));
        ctx.stream().clone_dtoh(b).unwrap()
    }
    fn input(&mut self, ctx: &Context, name: &'static str, v: &[T]) {
        self.data.insert(name, upload(ctx, v));
    }
    fn output(&mut self, ctx: &Context, name: &'static str, n: usize) {
        self.data.insert(name, poisoned::<T>(ctx, n));
    }
    fn stat_in(&mut self, ctx: &Context, name: &'static str, v: &[f32]) {
        self.stats.insert(name, upload(ctx, v));
    }
    fn stat_out(&mut self, ctx: &Context, name: &'static str, n: usize) {
        self.stats.insert(name, poisoned::<f32>(ctx, n));
    }
    fn get(&self, ctx: &Context, name: &str) -> Vec<f64> {
        match (self.data.get(name), self.stats.get(name)) {
            (Some(b), _) => f64s(&download(ctx, b)),
            (_, Some(b)) => f64s(&download(ctx, b)),
            _ => panic!("no buffer {name}"),
        }
    }
}

/// Builds the graph with `build` on the Context's handle, searches its plans (printed), and
/// with `io` runs the first plan once. Returns the search and whether it ran; the build's
/// failure is returned as the reason.
fn probe<T: Element>(
    ctx: &Context,
    title: &str,
    build: impl FnOnce(nnfuse::cudarc::cudnn::sys::cudnnHandle_t) -> nnfuse::Result<FusionGraph>,
    io: Option<&mut Io<T>>,
) -> Result<(PlanSearch, bool), String> {
    let stream = ctx.stream().clone();
    let mut g = ctx.lock().unwrap();
    let h = g.cudnn().unwrap();
    let graph = build(h).map_err(|e| {
        format!(
            "graph build: {e} ({})",
            nnfuse::internals::cudnn_graph::last_error_string()
        )
    })?;
    let search = search_plans(h, &graph.graph, MAX_PLANS);
    print_search(title, &search);
    let (Some(io), Some((_, plan))) = (io, &search.plan) else {
        return Ok((search, false));
    };
    let ws = g.workspace(plan.workspace()).unwrap();
    let mut addrs: HashMap<&str, u64> = io.scalars.clone();
    let mut guards = Vec::new();
    for (name, b) in io.data.iter_mut() {
        let (p, guard) = b.device_ptr_mut(&stream);
        addrs.insert(name, p);
        guards.push(guard);
    }
    for (name, b) in io.stats.iter_mut() {
        let (p, guard) = b.device_ptr_mut(&stream);
        addrs.insert(name, p);
        guards.push(guard);
    }
    for (name, b) in io.bytes.iter_mut() {
        let (p, guard) = b.device_ptr_mut(&stream);
        addrs.insert(name, p);
        guards.push(guard);
    }
    let (uids, ptrs) = graph
        .pack_of(|n| addrs.get(n).copied())
        .unwrap_or_else(|e| panic!("{title}: {e}"));
    let pack = fusion_variant_pack(&uids, &ptrs, ws).unwrap();
    // SAFETY: every buffer is sized for the graph's tensors and lives on the Context's stream;
    // the scalars outlive the call.
    let r = unsafe { fusion_execute(h, plan, &pack) };
    drop(guards);
    drop(g);
    stream.synchronize().unwrap();
    match r {
        Ok(()) => Ok((search, true)),
        Err(e) => Err(format!(
            "execute: {e} ({})",
            nnfuse::internals::cudnn_graph::last_error_string()
        )),
    }
}

/// Prints the outcome of a probe that does not run (the demo's shapes).
fn finalize_only<T: Element>(
    ctx: &Context,
    pattern: &str,
    shape: &str,
    build: impl FnOnce(nnfuse::cudarc::cudnn::sys::cudnnHandle_t) -> nnfuse::Result<FusionGraph>,
) {
    println!("== {pattern} {} {shape} (finalize only)", T::DTYPE.name());
    match probe::<T>(ctx, pattern, build, None) {
        Ok((s, _)) if s.plan.is_some() => {
            println!("{}", summary(pattern, T::DTYPE, shape, &s, None))
        }
        Ok((s, _)) => println!(
            "{} NOT SUPPORTED: no config finalized",
            summary(pattern, T::DTYPE, shape, &s, None)
        ),
        Err(m) => println!(
            "PROBE {pattern} {} {shape}: NOT SUPPORTED: {m}",
            T::DTYPE.name()
        ),
    }
}

/// The tolerance of a data output (relative L2): f16/bf16 storage; for f32 data the probe
/// applies no engine policy, so a TF32 engine may run.
const DATA_TOL: f64 = 1e-2;

/// The tolerance of f32 statistics computed from data stored in `T`: the rounding of `T`
/// (whether cuDNN sums the stored or the unrounded values is not documented), at least 1e-4.
fn stat_tol<T: Element>() -> f64 {
    match T::DTYPE {
        DType::F32 => 1e-4,
        DType::F16 => 1e-3,
        DType::BF16 => 8e-3,
    }
}

/// Checks `got` against `want` within `tol`, recording the error in `max`.
fn check(what: &str, got: &[f64], want: &[f64], tol: f64, max: &mut f64) {
    let e = rel_l2(got, want);
    let bad = got.iter().position(|v| !v.is_finite());
    println!("    {what}: rel L2 {e:.3e} (tol {tol:.0e})");
    assert!(
        bad.is_none() && e <= tol,
        "{what}: relative L2 error {e:.3e} > {tol:.1e} (first non-finite at {bad:?}); got {:?} want {:?}",
        &got[..got.len().min(6)],
        &want[..want.len().min(6)]
    );
    *max = max.max(e);
}

/// Per-channel sum and sum of squares of NHWC data with `c` channels.
fn channel_sums(y: &[f64], c: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut s, mut q) = (vec![0.0; c], vec![0.0; c]);
    for (i, v) in y.iter().enumerate() {
        s[i % c] += v;
        q[i % c] += v * v;
    }
    (s, q)
}

/// `relu(x · s + b)` per channel of NHWC `x`.
fn prologue_ref(x: &[f64], s: &[f64], b: &[f64]) -> Vec<f64> {
    let c = s.len();
    x.iter()
        .enumerate()
        .map(|(i, v)| (v * s[i % c] + b[i % c]).max(0.0))
        .collect()
}

// ---------------------------------------------------------------- ConvBNfprop (conv → genstats)

fn conv_genstats_case<T: Element>(ctx: &Context, shape: ConvShape, prologue: bool) {
    let pattern = if prologue {
        "ConvBNfprop-SBRCS"
    } else {
        "ConvGenStats"
    };
    let dt = T::DTYPE;
    let spec = |shape| ConvGenStats {
        shape,
        dtype: dt,
        prologue: prologue.then_some(Prologue {
            affine: dt,
            relu: ReluAttrs::Frontend,
        }),
        genstats_prec: DType::F32,
    };
    let mut rng = Rng::fresh(pattern);
    // Positive-leaning data: the per-channel sums stay away from zero.
    let x: Vec<T> = rng.vec(shape.x_len().unwrap(), -0.5, 1.0);
    let w: Vec<T> = rng.vec(shape.w_len().unwrap(), -0.5, 1.0);
    let s: Vec<T> = rng.vec(shape.c_in, 0.5, 1.5);
    let b: Vec<T> = rng.vec(shape.c_in, -0.5, 0.5);
    let k = shape.c_out;
    let mut io = Io::<T>::new();
    io.input(ctx, "x", &x);
    io.input(ctx, "w", &w);
    io.output(ctx, "y", shape.y_len().unwrap());
    io.stat_out(ctx, "sum", k);
    io.stat_out(ctx, "sqsum", k);
    if prologue {
        io.input(ctx, "scale", &s);
        io.input(ctx, "bias", &b);
    }
    let sl = label(&shape);
    println!("== {pattern} {} {sl}", dt.name());
    let mut r = probe(ctx, pattern, |h| spec(shape).build(h), Some(&mut io));
    if let Ok((search, false)) = &r {
        if search.plan.is_none() {
            // The frontend's node computes GEN_STATS in y's type: try that too.
            let alt = ConvGenStats {
                genstats_prec: dt,
                ..spec(shape)
            };
            println!("  (retry with GEN_STATS math precision {})", dt.name());
            r = probe(ctx, pattern, |h| alt.build(h), Some(&mut io));
        }
    }
    let (search, ran) = match r {
        Err(m) => return println!("PROBE {pattern} {} {sl}: NOT SUPPORTED: {m}", dt.name()),
        Ok(v) => v,
    };
    if !ran {
        return println!(
            "{} NOT SUPPORTED: no config finalized",
            summary(pattern, dt, &sl, &search, None)
        );
    }
    let xin = if prologue {
        prologue_ref(&f64s(&x), &f64s(&s), &f64s(&b))
    } else {
        f64s(&x)
    };
    let y_ref = conv2d(&shape, &xin, &f64s(&w)).unwrap();
    let y = io.get(ctx, "y");
    let mut max = 0.0;
    check("y", &y, &y_ref, DATA_TOL, &mut max);
    let (sum_ref, sq_ref) = channel_sums(&y, k);
    check(
        "sum (of stored y)",
        &io.get(ctx, "sum"),
        &sum_ref,
        stat_tol::<T>(),
        &mut max,
    );
    check(
        "sqsum (of stored y)",
        &io.get(ctx, "sqsum"),
        &sq_ref,
        stat_tol::<T>(),
        &mut max,
    );
    println!("{}", summary(pattern, dt, &sl, &search, Some(max)));
}

fn conv_genstats_all<T: Element>(ctx: &Context, prologue: bool) {
    let pattern = if prologue {
        "ConvBNfprop-SBRCS"
    } else {
        "ConvGenStats"
    };
    // conv1 (1x1 256->64, no prologue); conv2 (3x3 64->64) and conv3 (1x1 64->256) after a BN.
    let demo: Vec<ConvShape> = if prologue {
        vec![nhwc(4, 64, 56, 64, 3), nhwc(4, 64, 56, 256, 1)]
    } else {
        vec![nhwc(4, 256, 56, 64, 1), nhwc(4, 64, 56, 64, 3)]
    };
    for s in demo {
        let spec = ConvGenStats {
            shape: s,
            dtype: T::DTYPE,
            prologue: prologue.then_some(Prologue {
                affine: T::DTYPE,
                relu: ReluAttrs::Frontend,
            }),
            genstats_prec: DType::F32,
        };
        finalize_only::<T>(ctx, pattern, &label(&s), |h| spec.build(h));
        if prologue && T::DTYPE != DType::F32 {
            // The chain's prologue applies a scale and bias rounded to T; f32 ones would keep
            // its forward ReLU mask equal to the one its backward recomputes in f32.
            let f32_affine = ConvGenStats {
                prologue: Some(Prologue {
                    affine: DType::F32,
                    relu: ReluAttrs::Frontend,
                }),
                ..spec
            };
            finalize_only::<T>(ctx, "ConvBNfprop-SBRCS-f32-affine", &label(&s), |h| {
                f32_affine.build(h)
            });
        }
    }
    let small: Vec<ConvShape> = if prologue {
        vec![nhwc(2, 64, 8, 64, 3), nhwc(2, 64, 8, 256, 1)]
    } else {
        vec![nhwc(2, 256, 8, 64, 1), nhwc(2, 64, 8, 64, 3)]
    };
    for s in small {
        conv_genstats_case::<T>(ctx, s, prologue);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn probe_conv_genstats() {
    let Some(ctx) = gpu() else { return };
    conv_genstats_all::<f16>(&ctx, false);
    conv_genstats_all::<bf16>(&ctx, false);
    conv_genstats_all::<f32>(&ctx, false);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn probe_conv_bn_fprop_sbrcs() {
    let Some(ctx) = gpu() else { return };
    conv_genstats_all::<f16>(&ctx, true);
    conv_genstats_all::<bf16>(&ctx, true);
    conv_genstats_all::<f32>(&ctx, true);
}

// ------------------------------------------------------------------------------ BN finalize

fn bn_finalize_case(ctx: &Context, c: usize, scalar: ElemType) {
    let pattern = "BNFinalize";
    let m: i64 = 2 * 8 * 8;
    let (eps, momentum) = (1e-5f64, 0.1f64);
    let mut rng = Rng::fresh(pattern);
    let mean: Vec<f64> = (0..c).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let var: Vec<f64> = (0..c).map(|_| rng.uniform(0.5, 2.0)).collect();
    let mf = m as f64;
    let sum: Vec<f32> = mean.iter().map(|u| (mf * u) as f32).collect();
    let sqsum: Vec<f32> = mean
        .iter()
        .zip(&var)
        .map(|(u, v)| (mf * (v + u * u)) as f32)
        .collect();
    let scale: Vec<f32> = rng.vec(c, 0.5, 1.5);
    let bias: Vec<f32> = rng.vec(c, -0.5, 0.5);
    let prev_mean: Vec<f32> = rng.vec(c, -0.5, 0.5);
    let prev_var: Vec<f32> = rng.vec(c, 0.5, 1.5);
    let mut io = Io::<f32>::new();
    for (n, v) in [
        ("sum", &sum),
        ("sqsum", &sqsum),
        ("scale", &scale),
        ("bias", &bias),
        ("prev_mean", &prev_mean),
        ("prev_var", &prev_var),
    ] {
        io.stat_in(ctx, n, v);
    }
    for n in [
        "next_mean",
        "next_var",
        "saved_mean",
        "saved_inv_std",
        "eq_scale",
        "eq_bias",
    ] {
        io.stat_out(ctx, n, c);
    }
    let (eps32, mom32) = (eps as f32, momentum as f32);
    let accum = m;
    let scalar_name = match scalar {
        ElemType::Double => {
            io.scalars.insert("epsilon", &eps as *const f64 as u64);
            io.scalars
                .insert("momentum", &momentum as *const f64 as u64);
            "double"
        }
        _ => {
            io.scalars.insert("epsilon", &eps32 as *const f32 as u64);
            io.scalars.insert("momentum", &mom32 as *const f32 as u64);
            "float"
        }
    };
    io.scalars
        .insert("accum_count", &accum as *const i64 as u64);
    let sl = format!("c{c} m{m} scalars-{scalar_name}");
    println!("== {pattern} f32 {sl}");
    let (search, ran) = match probe(
        ctx,
        pattern,
        |h| bn_finalize(h, c as i64, scalar),
        Some(&mut io),
    ) {
        Err(e) => return println!("PROBE {pattern} f32 {sl}: NOT SUPPORTED: {e}"),
        Ok(v) => v,
    };
    if !ran {
        return println!(
            "{} NOT SUPPORTED: no config finalized",
            summary(pattern, DType::F32, &sl, &search, None)
        );
    }
    // The reference from the f32 sums as stored.
    let (s64, q64) = (f64s(&sum), f64s(&sqsum));
    let mu: Vec<f64> = s64.iter().map(|s| s / mf).collect();
    let v_b: Vec<f64> = q64.iter().zip(&mu).map(|(q, u)| q / mf - u * u).collect();
    let inv: Vec<f64> = v_b.iter().map(|v| 1.0 / (v + eps).sqrt()).collect();
    let eq_s: Vec<f64> = (0..c).map(|i| scale[i] as f64 * inv[i]).collect();
    let eq_b: Vec<f64> = (0..c).map(|i| bias[i] as f64 - mu[i] * eq_s[i]).collect();
    let next_m: Vec<f64> = (0..c)
        .map(|i| (1.0 - momentum) * prev_mean[i] as f64 + momentum * mu[i])
        .collect();
    let next_v = |unbiased: bool| -> Vec<f64> {
        let f = if unbiased { mf / (mf - 1.0) } else { 1.0 };
        (0..c)
            .map(|i| (1.0 - momentum) * prev_var[i] as f64 + momentum * v_b[i] * f)
            .collect()
    };
    let mut max = 0.0;
    let tol = 1e-4;
    check("saved_mean", &io.get(ctx, "saved_mean"), &mu, tol, &mut max);
    check(
        "saved_inv_std",
        &io.get(ctx, "saved_inv_std"),
        &inv,
        tol,
        &mut max,
    );
    check("eq_scale", &io.get(ctx, "eq_scale"), &eq_s, tol, &mut max);
    check("eq_bias", &io.get(ctx, "eq_bias"), &eq_b, tol, &mut max);
    check(
        "next_mean",
        &io.get(ctx, "next_mean"),
        &next_m,
        tol,
        &mut max,
    );
    let got_v = io.get(ctx, "next_var");
    let (eu, eb) = (
        rel_l2(&got_v, &next_v(true)),
        rel_l2(&got_v, &next_v(false)),
    );
    println!(
        "    next_var: rel L2 {eu:.3e} against the unbiased update, {eb:.3e} against the biased"
    );
    assert!(
        eu.min(eb) <= tol,
        "next_var matches neither the unbiased ({eu:.3e}) nor the biased ({eb:.3e}) update"
    );
    max = f64::max(max, eu.min(eb));
    println!("{}", summary(pattern, DType::F32, &sl, &search, Some(max)));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn probe_bn_finalize() {
    let Some(ctx) = gpu() else { return };
    for c in [64, 256] {
        bn_finalize_case(&ctx, c, ElemType::Data(DType::F32));
        bn_finalize_case(&ctx, c, ElemType::Double);
    }
}

// ------------------------------------------------------------------------------ ConvBNwgrad

fn wgrad_case<T: Element>(ctx: &Context, shape: ConvShape) {
    let pattern = "ConvBNwgrad";
    let dt = T::DTYPE;
    let p = Prologue {
        affine: dt,
        relu: ReluAttrs::Frontend,
    };
    let mut rng = Rng::fresh(pattern);
    let x: Vec<T> = rng.vec(shape.x_len().unwrap(), -1.0, 1.0);
    let dy: Vec<T> = rng.vec(shape.y_len().unwrap(), -1.0, 1.0);
    let s: Vec<T> = rng.vec(shape.c_in, 0.5, 1.5);
    let b: Vec<T> = rng.vec(shape.c_in, -0.5, 0.5);
    let mut io = Io::<T>::new();
    io.input(ctx, "x", &x);
    io.input(ctx, "dy", &dy);
    io.input(ctx, "scale", &s);
    io.input(ctx, "bias", &b);
    io.output(ctx, "dw", shape.w_len().unwrap());
    let sl = label(&shape);
    println!("== {pattern} {} {sl}", dt.name());
    let (search, ran) = match probe(
        ctx,
        pattern,
        |h| wgrad_prologue(h, &shape, dt, p),
        Some(&mut io),
    ) {
        Err(m) => return println!("PROBE {pattern} {} {sl}: NOT SUPPORTED: {m}", dt.name()),
        Ok(v) => v,
    };
    if !ran {
        return println!(
            "{} NOT SUPPORTED: no config finalized",
            summary(pattern, dt, &sl, &search, None)
        );
    }
    let r = prologue_ref(&f64s(&x), &f64s(&s), &f64s(&b));
    let dw_ref = conv2d_backward_filter(&shape, &r, &f64s(&dy)).unwrap();
    let mut max = 0.0;
    check("dw", &io.get(ctx, "dw"), &dw_ref, DATA_TOL, &mut max);
    println!("{}", summary(pattern, dt, &sl, &search, Some(max)));
}

fn wgrad_all<T: Element>(ctx: &Context) {
    for s in [nhwc(4, 64, 56, 64, 3), nhwc(4, 64, 56, 256, 1)] {
        let p = Prologue {
            affine: T::DTYPE,
            relu: ReluAttrs::Frontend,
        };
        finalize_only::<T>(ctx, "ConvBNwgrad", &label(&s), |h| {
            wgrad_prologue(h, &s, T::DTYPE, p)
        });
        if T::DTYPE != DType::F32 {
            let f32_affine = Prologue {
                affine: DType::F32,
                ..p
            };
            finalize_only::<T>(ctx, "ConvBNwgrad-f32-affine", &label(&s), |h| {
                wgrad_prologue(h, &s, T::DTYPE, f32_affine)
            });
        }
    }
    for s in [nhwc(2, 64, 8, 64, 3), nhwc(2, 64, 8, 256, 1)] {
        wgrad_case::<T>(ctx, s);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn probe_conv_bn_wgrad() {
    let Some(ctx) = gpu() else { return };
    wgrad_all::<f16>(&ctx);
    wgrad_all::<bf16>(&ctx);
    wgrad_all::<f32>(&ctx);
}

// ------------------------------------------------------------------- DgradDreluBNBwdWeight

fn dgrad_drelu_case<T: Element>(ctx: &Context, shape: ConvShape) {
    let pattern = "DgradDreluBNBwdWeight";
    let dt = T::DTYPE;
    let c = shape.c_in;
    let mut rng = Rng::fresh(pattern);
    let dy: Vec<T> = rng.vec(shape.y_len().unwrap(), -1.0, 1.0);
    let w: Vec<T> = rng.vec(shape.w_len().unwrap(), -1.0, 1.0);
    let x: Vec<T> = rng.vec(shape.x_len().unwrap(), -1.0, 1.0);
    let mean: Vec<f32> = rng.vec(c, -0.2, 0.2);
    let inv_std: Vec<f32> = rng.vec(c, 0.5, 2.0);
    let scale: Vec<f32> = rng.vec(c, 0.5, 1.5);
    let bias: Vec<f32> = rng.vec(c, -0.5, 0.5);
    let mut io = Io::<T>::new();
    io.input(ctx, "dy", &dy);
    io.input(ctx, "w", &w);
    io.input(ctx, "x", &x);
    io.output(ctx, "drelu", shape.x_len().unwrap());
    for (n, v) in [
        ("mean", &mean),
        ("inv_std", &inv_std),
        ("scale", &scale),
        ("bias", &bias),
    ] {
        io.stat_in(ctx, n, v);
    }
    for n in ["dscale", "dbias", "eq_scale_dy", "eq_scale_x", "eq_bias"] {
        io.stat_out(ctx, n, c);
    }
    let sl = label(&shape);
    println!("== {pattern} {} {sl}", dt.name());
    let build = |h| dgrad_drelu_dbn_weight(h, &shape, dt, ReluAttrs::Frontend);
    let (search, ran) = match probe(ctx, pattern, build, Some(&mut io)) {
        Err(m) => return println!("PROBE {pattern} {} {sl}: NOT SUPPORTED: {m}", dt.name()),
        Ok(v) => v,
    };
    if !ran {
        return println!(
            "{} NOT SUPPORTED: no config finalized",
            summary(pattern, dt, &sl, &search, None)
        );
    }
    let xs = f64s(&x);
    let (mu, is, sc, bi) = (f64s(&mean), f64s(&inv_std), f64s(&scale), f64s(&bias));
    let dgrad = conv2d_backward_data(&shape, &f64s(&dy), &f64s(&w)).unwrap();
    let drelu_ref: Vec<f64> = dgrad
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let ch = i % c;
            let bn = (xs[i] - mu[ch]) * is[ch] * sc[ch] + bi[ch];
            if bn > 0.0 {
                *g
            } else {
                0.0
            }
        })
        .collect();
    let mut max = 0.0;
    let drelu = io.get(ctx, "drelu");
    check("drelu", &drelu, &drelu_ref, DATA_TOL, &mut max);
    // BN's backward weights from the stored drelu (the operation's own input).
    let m = (xs.len() / c) as f64;
    let (mut ds, mut db) = (vec![0.0; c], vec![0.0; c]);
    for (i, d) in drelu.iter().enumerate() {
        let ch = i % c;
        ds[ch] += d * (xs[i] - mu[ch]) * is[ch];
        db[ch] += d;
    }
    let tol = stat_tol::<T>().max(1e-3);
    check("dscale", &io.get(ctx, "dscale"), &ds, tol, &mut max);
    check("dbias", &io.get(ctx, "dbias"), &db, tol, &mut max);
    // The equivalent coefficients, checked by what they mean: dx = a·dy + b·x + c equals BN's
    // data gradient with the given statistics.
    let (a, bx, c0) = (
        io.get(ctx, "eq_scale_dy"),
        io.get(ctx, "eq_scale_x"),
        io.get(ctx, "eq_bias"),
    );
    let (mut dx_eq, mut dx_ref) = (Vec::new(), Vec::new());
    for (i, d) in drelu.iter().enumerate() {
        let ch = i % c;
        dx_eq.push(a[ch] * d + bx[ch] * xs[i] + c0[ch]);
        let xhat = (xs[i] - mu[ch]) * is[ch];
        dx_ref.push(sc[ch] * is[ch] * (d - db[ch] / m - xhat * ds[ch] / m));
    }
    check(
        "dx from eq_scale_dy/eq_scale_x/eq_bias",
        &dx_eq,
        &dx_ref,
        tol,
        &mut max,
    );
    println!("{}", summary(pattern, dt, &sl, &search, Some(max)));
}

fn dgrad_drelu_all<T: Element>(ctx: &Context) {
    for s in [nhwc(4, 64, 56, 64, 3), nhwc(4, 64, 56, 256, 1)] {
        finalize_only::<T>(ctx, "DgradDreluBNBwdWeight", &label(&s), |h| {
            dgrad_drelu_dbn_weight(h, &s, T::DTYPE, ReluAttrs::Frontend)
        });
    }
    for s in [nhwc(2, 64, 8, 64, 3), nhwc(2, 64, 8, 256, 1)] {
        dgrad_drelu_case::<T>(ctx, s);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn probe_dgrad_drelu_bn_bwd_weight() {
    let Some(ctx) = gpu() else { return };
    dgrad_drelu_all::<f16>(&ctx);
    dgrad_drelu_all::<bf16>(&ctx);
    dgrad_drelu_all::<f32>(&ctx);
}

// ----------------------------------------------------------------- data gradient, beta = 1

fn dgrad_accumulate_case<T: Element>(ctx: &Context, shape: ConvShape) {
    let pattern = "DgradAccumulate";
    let dt = T::DTYPE;
    let mut rng = Rng::fresh(pattern);
    let dy: Vec<T> = rng.vec(shape.y_len().unwrap(), -1.0, 1.0);
    let w: Vec<T> = rng.vec(shape.w_len().unwrap(), -1.0, 1.0);
    let dx0: Vec<T> = rng.vec(shape.x_len().unwrap(), -4.0, 4.0);
    let mut io = Io::<T>::new();
    io.input(ctx, "dy", &dy);
    io.input(ctx, "w", &w);
    // Accumulation reads dx: it starts as data, not poison.
    io.input(ctx, "dx", &dx0);
    let sl = label(&shape);
    println!("== {pattern} {} {sl}", dt.name());
    let (search, ran) = match probe(
        ctx,
        pattern,
        |h| dgrad_accumulate(h, &shape, dt),
        Some(&mut io),
    ) {
        Err(m) => return println!("PROBE {pattern} {} {sl}: NOT SUPPORTED: {m}", dt.name()),
        Ok(v) => v,
    };
    if !ran {
        return println!(
            "{} NOT SUPPORTED: no config finalized",
            summary(pattern, dt, &sl, &search, None)
        );
    }
    let g = conv2d_backward_data(&shape, &f64s(&dy), &f64s(&w)).unwrap();
    let want: Vec<f64> = g.iter().zip(f64s(&dx0)).map(|(a, b)| a + b).collect();
    let mut max = 0.0;
    check("dx0 + dgrad", &io.get(ctx, "dx"), &want, DATA_TOL, &mut max);
    println!("{}", summary(pattern, dt, &sl, &search, Some(max)));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn probe_dgrad_accumulate() {
    let Some(ctx) = gpu() else { return };
    for s in [nhwc(2, 256, 8, 64, 1), nhwc(2, 64, 8, 64, 3)] {
        dgrad_accumulate_case::<f16>(&ctx, s);
        dgrad_accumulate_case::<bf16>(&ctx, s);
        dgrad_accumulate_case::<f32>(&ctx, s);
    }
}

// ------------------------------------------------- nnfuse's BatchNorm epilogue graphs, again

/// The plan search of `key`'s training graph as nnfuse builds it (`relu` none) or with the
/// ReLU described by `relu`; the graph's parts live until the search is done.
fn search_bn(
    ctx: &Context,
    title: &str,
    key: &GraphBnKey,
    relu: Option<ReluAttrs>,
) -> Result<PlanSearch, String> {
    let mut g = ctx.lock().unwrap();
    let h = g.cudnn().unwrap();
    let failed = |e: Error| {
        format!(
            "graph build: {e} ({})",
            nnfuse::internals::cudnn_graph::last_error_string()
        )
    };
    let s = match relu {
        None => {
            let parts = BnGraphParts::build(h, key).map_err(failed)?;
            search_plans(h, &parts.graph, MAX_PLANS)
        }
        Some(r) => {
            let parts = bn_epilogue(h, key, false, r).map_err(failed)?;
            search_plans(h, &parts.graph, MAX_PLANS)
        }
    };
    print_search(title, &s);
    Ok(s)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn probe_bn_epilogue_graphs() {
    let Some(ctx) = gpu() else { return };
    let layout = ChannelLayout {
        n: 4,
        c: 64,
        h: 56 * 56,
        w: 1,
        format: TensorFormat::Nhwc,
        rank: 4,
    };
    for dt in [DType::F16, DType::BF16, DType::F32] {
        for epi in [BnEpilogue::None, BnEpilogue::Relu, BnEpilogue::AddRelu] {
            let key = GraphBnKey::new(layout, dt, BnDirection::Forward).with_epilogue(epi);
            let sl = format!("n4 c64 56x56 training {epi:?}");
            // As nnfuse builds it (bn_build.rs), then with cudnn-frontend's ReLU attributes.
            let variants: [(&str, Option<ReluAttrs>); 2] = [
                ("nnfuse", None),
                ("frontend-relu", Some(ReluAttrs::Frontend)),
            ];
            for (name, relu) in variants {
                if relu.is_some() && epi == BnEpilogue::None {
                    continue;
                }
                let pattern = format!("BN-epilogue-{name}");
                println!("== {pattern} {} {sl}", dt.name());
                let r = search_bn(&ctx, &pattern, &key, relu);
                match r {
                    Err(m) => println!("PROBE {pattern} {} {sl}: NOT SUPPORTED: {m}", dt.name()),
                    Ok(s) if s.plan.is_none() => println!(
                        "{} NOT SUPPORTED: no config finalized",
                        summary(&pattern, dt, &sl, &s, None)
                    ),
                    Ok(s) => println!("{}", summary(&pattern, dt, &sl, &s, None)),
                }
            }
        }
    }
}

// ------------------------------------- BatchNorm + (Add +) ReLU with cuDNN's BOOLEAN mask
//
// cudnn-frontend's "SGBN Add Relu" forward with `CMP_GT` writing the ReLU mask as a real
// BOOLEAN tensor (test_batchnorm.py's `test_bn_relu_with_mask`), and its "DBN Add Relu"
// backward (`dy · mask → NORM_BACKWARD`, the masked dy written as d_addend with Add+ReLU). The
// mask buffer is 1 byte per element; which layout cuDNN uses (a byte per element, or bits packed
// LSB first as the DBN sample's numel/8 allocation suggests) is what the probe reports.

const EPS: f64 = 1e-5;
const MOMENTUM: f64 = 0.1;

fn label_dims(d: [i64; 4]) -> String {
    format!("n{} c{} {}x{}", d[0], d[1], d[2], d[3])
}

fn mask_pattern(add: bool, source: MaskSource, comparand: MaskComparand) -> String {
    let src = match source {
        MaskSource::Y => "y",
        MaskSource::PreRelu => "prerelu",
    };
    let cmp = match comparand {
        MaskComparand::ScalarZero => "scalar0",
        MaskComparand::ZerosTensor => "zeros",
    };
    let epi = if add { "add_relu" } else { "relu" };
    format!("BNMaskFwd-{epi}-cmp_{src}-{cmp}")
}

/// The f64 reference of a training BatchNorm (+ addend) + ReLU over NHWC data with `c`
/// channels: pre-activation, y, batch mean, biased variance, inverse std.
struct BnFwdRef {
    pre: Vec<f64>,
    y: Vec<f64>,
    mean: Vec<f64>,
    var: Vec<f64>,
    inv: Vec<f64>,
}

fn bn_forward_ref(x: &[f64], z: Option<&[f64]>, g: &[f64], b: &[f64]) -> BnFwdRef {
    let c = g.len();
    let m = (x.len() / c) as f64;
    let (mut mean, mut var) = (vec![0.0; c], vec![0.0; c]);
    for (i, v) in x.iter().enumerate() {
        mean[i % c] += v / m;
    }
    for (i, v) in x.iter().enumerate() {
        let d = v - mean[i % c];
        var[i % c] += d * d / m;
    }
    let inv: Vec<f64> = var.iter().map(|v| 1.0 / (v + EPS).sqrt()).collect();
    let pre: Vec<f64> = x
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let ch = i % c;
            (v - mean[ch]) * inv[ch] * g[ch] + b[ch] + z.map_or(0.0, |z| z[i])
        })
        .collect();
    let y = pre.iter().map(|p| p.max(0.0)).collect();
    BnFwdRef {
        pre,
        y,
        mean,
        var,
        inv,
    }
}

/// Which layout `got` holds the mask `want` in, over the elements not `skip`ped: one byte per
/// element (non-zero = set), or bits packed LSB first. `Err` gives both mismatch counts.
fn mask_layout(got: &[u8], want: &[bool], skip: &[bool]) -> Result<&'static str, String> {
    let idx = || (0..want.len()).filter(|&i| !skip[i]);
    let byte_bad = idx().filter(|&i| (got[i] != 0) != want[i]).count();
    let bit_bad = idx()
        .filter(|&i| ((got[i / 8] >> (i % 8)) & 1 == 1) != want[i])
        .count();
    match (byte_bad, bit_bad) {
        (0, _) => Ok("bytes (1 per element)"),
        (_, 0) => Ok("packed bits (LSB first)"),
        (a, b) => Err(format!(
            "the mask matches neither layout: {a} mismatches as bytes, {b} as packed bits, of {} \
             elements",
            want.len()
        )),
    }
}

/// `want` as a mask of `layout` (bytes or packed bits), `n` bytes long.
fn encode_mask(want: &[bool], packed: bool) -> Vec<u8> {
    let mut v = vec![0u8; want.len()];
    for (i, &w) in want.iter().enumerate() {
        if packed {
            v[i / 8] |= u8::from(w) << (i % 8);
        } else {
            v[i] = u8::from(w);
        }
    }
    v
}

/// What a forward that ran hands to the chained backward: its x, saved statistics, the mask
/// cuDNN wrote, and which elements it must have set.
struct MaskFwdRun<T> {
    x: Vec<T>,
    saved_mean: Vec<f32>,
    saved_inv: Vec<f32>,
    mask: Vec<u8>,
    want: Vec<bool>,
}

fn mask_fwd_case<T: Element>(
    ctx: &Context,
    dims: [i64; 4],
    add: bool,
    source: MaskSource,
    comparand: MaskComparand,
) -> Option<MaskFwdRun<T>> {
    let pattern = mask_pattern(add, source, comparand);
    let dt = T::DTYPE;
    let c = dims[1] as usize;
    let n = dims.iter().product::<i64>() as usize;
    let mut rng = Rng::fresh(&pattern);
    let x: Vec<T> = rng.vec(n, -1.0, 1.5);
    let z: Vec<T> = rng.vec(n, -1.0, 1.0);
    let g: Vec<f32> = rng.vec(c, 0.5, 1.5);
    let b: Vec<f32> = rng.vec(c, -0.5, 0.5);
    let pm: Vec<f32> = rng.vec(c, -0.5, 0.5);
    let pv: Vec<f32> = rng.vec(c, 0.5, 1.5);
    let (eps, momentum, zero) = (EPS as f32, MOMENTUM as f32, 0.0f32);
    let mut io = Io::<T>::new();
    io.input(ctx, "x", &x);
    for (name, v) in [
        ("scale", &g),
        ("bias", &b),
        ("prev_mean", &pm),
        ("prev_var", &pv),
    ] {
        io.stat_in(ctx, name, v);
    }
    for name in ["next_mean", "next_var", "saved_mean", "saved_inv_var"] {
        io.stat_out(ctx, name, c);
    }
    io.output(ctx, "y", n);
    io.bytes_out(ctx, "mask", n);
    if add {
        io.input(ctx, "addend", &z);
    }
    match comparand {
        MaskComparand::ScalarZero => {
            io.scalars.insert("zero", &zero as *const f32 as u64);
        }
        MaskComparand::ZerosTensor => io.input(ctx, "zeros", &vec![T::from_f64(0.0); n]),
    }
    io.scalars.insert("epsilon", &eps as *const f32 as u64);
    io.scalars
        .insert("momentum", &momentum as *const f32 as u64);
    let spec = BnMaskForward {
        dims,
        dtype: dt,
        add,
        source,
        comparand,
    };
    let sl = label_dims(dims);
    println!("== {pattern} {} {sl}", dt.name());
    let (search, ran) = match probe(ctx, &pattern, |h| spec.build(h), Some(&mut io)) {
        Err(m) => {
            println!("PROBE {pattern} {} {sl}: NOT SUPPORTED: {m}", dt.name());
            return None;
        }
        Ok(v) => v,
    };
    if !ran {
        println!(
            "{} NOT SUPPORTED: no config finalized",
            summary(&pattern, dt, &sl, &search, None)
        );
        return None;
    }
    let zs = f64s(&z);
    let r = bn_forward_ref(
        &f64s(&x),
        add.then_some(zs.as_slice()),
        &f64s(&g),
        &f64s(&b),
    );
    let mut max = 0.0;
    let y = io.get(ctx, "y");
    check("y", &y, &r.y, DATA_TOL, &mut max);
    let st = stat_tol::<T>();
    let saved_mean = io.get(ctx, "saved_mean");
    let saved_inv = io.get(ctx, "saved_inv_var");
    check("saved_mean", &saved_mean, &r.mean, st, &mut max);
    check("saved_inv_var", &saved_inv, &r.inv, st, &mut max);
    let mf = (n / c) as f64;
    let next_mean: Vec<f64> = (0..c)
        .map(|i| (1.0 - MOMENTUM) * pm[i] as f64 + MOMENTUM * r.mean[i])
        .collect();
    check(
        "next_mean",
        &io.get(ctx, "next_mean"),
        &next_mean,
        st,
        &mut max,
    );
    let next_var = |unbiased: bool| -> Vec<f64> {
        let f = if unbiased { mf / (mf - 1.0) } else { 1.0 };
        (0..c)
            .map(|i| (1.0 - MOMENTUM) * pv[i] as f64 + MOMENTUM * r.var[i] * f)
            .collect()
    };
    let got_v = io.get(ctx, "next_var");
    let (eu, eb) = (
        rel_l2(&got_v, &next_var(true)),
        rel_l2(&got_v, &next_var(false)),
    );
    println!("    next_var: rel L2 {eu:.3e} against the unbiased update, {eb:.3e} the biased");
    assert!(
        eu.min(eb) <= st,
        "{pattern}: next_var matches neither update ({eu:.3e}, {eb:.3e})"
    );
    // The mask: y > 0, except where the pre-activation is within rounding of zero (either
    // side is right there).
    let rms = (r.pre.iter().map(|v| v * v).sum::<f64>() / n as f64).sqrt();
    let near = rms * T::DTYPE.tolerance();
    let skip: Vec<bool> = r.pre.iter().map(|p| p.abs() <= near).collect();
    let want: Vec<bool> = r.pre.iter().map(|&p| p > 0.0).collect();
    let mask = io.get_bytes(ctx, "mask");
    let layout = mask_layout(&mask, &want, &skip).unwrap_or_else(|e| panic!("{pattern}: {e}"));
    println!(
        "    mask: {layout}, {} elements within rounding of 0 skipped",
        skip.iter().filter(|&&k| k).count()
    );
    println!(
        "{}; mask layout {layout}",
        summary(&pattern, dt, &sl, &search, Some(max))
    );
    // The chained backward sees the GPU's own mask: where an element was skipped, the
    // reference follows what cuDNN wrote.
    let packed = layout.starts_with("packed");
    let want = (0..n)
        .map(|i| match (skip[i], packed) {
            (false, _) => want[i],
            (true, false) => mask[i] != 0,
            (true, true) => (mask[i / 8] >> (i % 8)) & 1 == 1,
        })
        .collect();
    let f32s = |v: &[f64]| v.iter().map(|&u| u as f32).collect::<Vec<f32>>();
    Some(MaskFwdRun {
        x,
        saved_mean: f32s(&saved_mean),
        saved_inv: f32s(&saved_inv),
        mask,
        want,
    })
}

/// The backward's outputs for one mask candidate, and their errors against the reference.
struct MaskBwdTry {
    label: &'static str,
    search: PlanSearch,
    errs: Vec<(&'static str, f64, f64, bool)>,
}

#[allow(clippy::too_many_arguments)]
fn mask_bwd_try<T: Element>(
    ctx: &Context,
    pattern: &str,
    dims: [i64; 4],
    add: bool,
    label: &'static str,
    x: &[T],
    stats: (&[f32], &[f32], &[f32]),
    dy: &[T],
    mask: &[u8],
    want: &[bool],
) -> Result<Option<MaskBwdTry>, String> {
    let (scale, mean, inv) = stats;
    let c = dims[1] as usize;
    let n = x.len();
    let mut io = Io::<T>::new();
    io.input(ctx, "x", x);
    io.input(ctx, "dy", dy);
    io.bytes_in(ctx, "mask", mask);
    io.output(ctx, "dx", n);
    if add {
        io.output(ctx, "d_addend", n);
    }
    for (name, v) in [("scale", scale), ("mean", mean), ("inv_var", inv)] {
        io.stat_in(ctx, name, v);
    }
    io.stat_out(ctx, "dscale", c);
    io.stat_out(ctx, "dbias", c);
    let build = |h| bn_mask_backward(h, dims, T::DTYPE, add);
    let (search, ran) = probe(ctx, pattern, build, Some(&mut io))?;
    if !ran {
        return Ok(None);
    }
    let (xs, dys) = (f64s(x), f64s(dy));
    let (sc, mu, is) = (f64s(scale), f64s(mean), f64s(inv));
    let g: Vec<f64> = (0..n).map(|i| if want[i] { dys[i] } else { 0.0 }).collect();
    let m = (n / c) as f64;
    let (mut ds, mut db) = (vec![0.0; c], vec![0.0; c]);
    for i in 0..n {
        let ch = i % c;
        ds[ch] += g[i] * (xs[i] - mu[ch]) * is[ch];
        db[ch] += g[i];
    }
    let dx: Vec<f64> = (0..n)
        .map(|i| {
            let ch = i % c;
            let xhat = (xs[i] - mu[ch]) * is[ch];
            sc[ch] * is[ch] * (g[i] - db[ch] / m - xhat * ds[ch] / m)
        })
        .collect();
    let st = stat_tol::<T>().max(1e-3);
    let mut outs = vec![
        ("dx", io.get(ctx, "dx"), dx, DATA_TOL),
        ("dscale", io.get(ctx, "dscale"), ds, st),
        ("dbias", io.get(ctx, "dbias"), db, st),
    ];
    if add {
        outs.push(("d_addend", io.get(ctx, "d_addend"), g, DATA_TOL));
    }
    let errs = outs
        .iter()
        .map(|(w, got, want, tol)| {
            let e = rel_l2(got, want);
            let finite = got.iter().all(|v| v.is_finite());
            println!("    [{label}] {w}: rel L2 {e:.3e} (tol {tol:.0e}), finite {finite}");
            (*w, e, *tol, finite && e <= *tol)
        })
        .collect();
    Ok(Some(MaskBwdTry {
        label,
        search,
        errs,
    }))
}

/// The backward at `dims`: with the mask a forward wrote (`fwd`), else with a random mask fed
/// as bytes and then as packed bits (whichever cuDNN reads is reported; neither matching fails).
fn mask_bwd_case<T: Element>(ctx: &Context, dims: [i64; 4], add: bool, fwd: Option<MaskFwdRun<T>>) {
    let dt = T::DTYPE;
    let pattern = format!("DBNMask-{}", if add { "add_relu" } else { "relu" });
    let c = dims[1] as usize;
    let n = dims.iter().product::<i64>() as usize;
    let mut rng = Rng::fresh(&pattern);
    let dy: Vec<T> = rng.vec(n, -1.0, 1.0);
    let scale: Vec<f32> = rng.vec(c, 0.5, 1.5);
    let sl = label_dims(dims);
    println!("== {pattern} {} {sl}", dt.name());
    type Candidate = (&'static str, Vec<u8>, Vec<bool>);
    let (x, mean, inv, candidates): (Vec<T>, Vec<f32>, Vec<f32>, Vec<Candidate>) = match fwd {
        Some(f) => {
            let cand = vec![("mask from the forward", f.mask, f.want)];
            (f.x, f.saved_mean, f.saved_inv, cand)
        }
        None => {
            let x: Vec<T> = rng.vec(n, -1.0, 1.5);
            let r = bn_forward_ref(&f64s(&x), None, &vec![1.0; c], &vec![0.0; c]);
            let want: Vec<bool> = (0..n).map(|_| rng.uniform(0.0, 1.0) > 0.4).collect();
            let f32s = |v: &[f64]| v.iter().map(|&u| u as f32).collect::<Vec<f32>>();
            let cand = vec![
                ("mask fed as bytes", encode_mask(&want, false), want.clone()),
                ("mask fed as packed bits", encode_mask(&want, true), want),
            ];
            (x, f32s(&r.mean), f32s(&r.inv), cand)
        }
    };
    let mut tries = Vec::new();
    for (label, mask, want) in &candidates {
        let stats = (scale.as_slice(), mean.as_slice(), inv.as_slice());
        match mask_bwd_try(ctx, &pattern, dims, add, label, &x, stats, &dy, mask, want) {
            Err(m) => return println!("PROBE {pattern} {} {sl}: NOT SUPPORTED: {m}", dt.name()),
            Ok(None) => {
                return println!(
                    "PROBE {pattern} {} {sl}: NOT SUPPORTED: no config finalized",
                    dt.name()
                )
            }
            Ok(Some(t)) => tries.push(t),
        }
    }
    let Some(ok) = tries.iter().find(|t| t.errs.iter().all(|e| e.3)) else {
        let why: Vec<String> = tries
            .iter()
            .map(|t| format!("{}: {:?}", t.label, t.errs))
            .collect();
        panic!(
            "{pattern} {} {sl}: wrong result with every mask: {why:?}",
            dt.name()
        );
    };
    let max = ok.errs.iter().map(|e| e.1).fold(0.0, f64::max);
    println!(
        "{}; {}",
        summary(&pattern, dt, &sl, &ok.search, Some(max)),
        ok.label
    );
}

/// The forward forms probed: what nnfuse builds first (CMP_GT of y against a by-value zero),
/// then the python test's zeros tensor, then the pre-ReLU value.
const MASK_FORMS: [(MaskSource, MaskComparand); 3] = [
    (MaskSource::Y, MaskComparand::ScalarZero),
    (MaskSource::Y, MaskComparand::ZerosTensor),
    (MaskSource::PreRelu, MaskComparand::ScalarZero),
];

fn mask_all<T: Element>(ctx: &Context) {
    let demo = [4, 64, 56, 56];
    let small = [2, 64, 8, 8];
    for add in [false, true] {
        for (source, comparand) in MASK_FORMS {
            let spec = BnMaskForward {
                dims: demo,
                dtype: T::DTYPE,
                add,
                source,
                comparand,
            };
            let p = mask_pattern(add, source, comparand);
            finalize_only::<T>(ctx, &p, &label_dims(demo), |h| spec.build(h));
        }
        let pattern = format!("DBNMask-{}", if add { "add_relu" } else { "relu" });
        finalize_only::<T>(ctx, &pattern, &label_dims(demo), |h| {
            bn_mask_backward(h, demo, T::DTYPE, add)
        });
        // Executed: every form's forward; the backward chained to the first that ran.
        let mut first = None;
        for (source, comparand) in MASK_FORMS {
            let r = mask_fwd_case::<T>(ctx, small, add, source, comparand);
            if first.is_none() {
                first = r;
            }
        }
        mask_bwd_case::<T>(ctx, small, add, first);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn probe_bn_relu_mask() {
    let Some(ctx) = gpu() else { return };
    mask_all::<f16>(&ctx);
    mask_all::<bf16>(&ctx);
    mask_all::<f32>(&ctx);
}
