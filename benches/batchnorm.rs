//! BatchNorm benchmark (issues 3 and 9): cuDNN fused vs fallback vs plain baseline vs nnfuse's
//! own kernels, forward and backward, on ResNet-50 shapes; the issue-9 table (own kernels vs
//! the cuDNN path and PyTorch's times measured earlier); inference in every type and layout;
//! the 2-D case; the own persistent variant against its two-pass variant; the 2-D paths under
//! each mode policy; dispatch overhead. CUDA events, warm-up, median of many, rotating buffers
//! so that L2 (50 MiB on the H100) does not hold the working set. Prints markdown tables and
//! JSON lines. `NNFUSE_BENCH_BN=demo` (or `demo64`, `demo256`): only `nnfuse demo`'s BatchNorm
//! shapes (f16 NHWC, batch 32), every path, for comparing one kernel change or profiling;
//! `NNFUSE_BENCH_BN=api`: only the legacy-against-graph-API section.
//!
//! Floors: bytes the operation must move (each input read once, each output written once; the
//! backward's activation state counted as the 1-bit mask) over the copy bandwidth measured in
//! the same run. The own kernels' "% of copy" counts the bytes their variant moves (two-pass:
//! x read twice forward, x and dy twice backward).

#[path = "support/exit.rs"]
mod exit;

use std::time::Instant;

use anyhow::Result;
use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use nnfuse::activation;
use nnfuse::batchnorm::{
    BackwardArgs, BatchNorm, BnOptions, BnPath, BnSaved, Fuse, InferenceArgs, OwnVariant,
    OwnVariantChoice, TrainArgs,
};
use nnfuse::internals::timing::{copy_bandwidth, time_gpu, TimingOptions};
use nnfuse::{BnImpl, BnModePolicy, Config, Context, CudnnApi, Element};

const L2_BYTES: usize = 50 << 20;

fn opts() -> TimingOptions {
    TimingOptions {
        warmup: 3,
        max_iters: 60,
        min_iters: 15,
        budget_ms: 60.0,
    }
}

/// One rotating copy of the per-call buffers.
struct Bufs<T> {
    x: CudaSlice<T>,
    z: CudaSlice<T>,
    y: CudaSlice<T>,
    dy: CudaSlice<T>,
    dx: CudaSlice<T>,
    dz: CudaSlice<T>,
}

struct Params {
    g: CudaSlice<f32>,
    b: CudaSlice<f32>,
    rm: CudaSlice<f32>,
    rv: CudaSlice<f32>,
    dg: CudaSlice<f32>,
    db: CudaSlice<f32>,
}

fn random<T: Element>(n: usize, seed: u64, lo: f64, hi: f64) -> Vec<T> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            T::from_f64(lo + (hi - lo) * ((s >> 11) as f64 / (1u64 << 53) as f64))
        })
        .collect()
}

#[derive(Default)]
struct Report {
    rows: Vec<String>,
}

impl Report {
    #[allow(clippy::too_many_arguments)]
    fn row(
        &mut self,
        case: &str,
        dir: &str,
        path: &str,
        us: f64,
        floor_us: f64,
        floor_bytes: f64,
        baseline_us: Option<f64>,
    ) {
        let ratio = baseline_us.map_or("-".to_string(), |b| format!("{:.2}x", b / us));
        let line = format!(
            "| {case} | {dir} | {path} | {us:.1} | {:.2} | {floor_us:.1} | {:.0}% | {ratio} |",
            floor_bytes / (us * 1e-6) / 1e12,
            100.0 * floor_us / us
        );
        println!("{line}");
        println!(
            "{{\"bench\":\"batchnorm\",\"case\":\"{case}\",\"dir\":\"{dir}\",\"path\":\"{path}\",\"us\":{us:.2},\"floor_us\":{floor_us:.2},\"speedup_vs_baseline\":{}}}",
            baseline_us.map_or("null".to_string(), |b| format!("{:.3}", b / us))
        );
        self.rows.push(line);
    }
}

const HEADER: &str = "| case | dir | path | median µs | TB/s (floor bytes) | floor µs | % of floor | speedup vs baseline |\n|---|---|---|---|---|---|---|---|";

#[allow(clippy::too_many_arguments)]
fn bench_case<T: Element>(
    ctx: &Context,
    fallback: &Context,
    own: &Context,
    shape: &[usize],
    axis: usize,
    fuse: Fuse,
    bw: f64,
    label: &str,
    report: &mut Report,
) -> Result<()> {
    let s = ctx.stream();
    let n: usize = shape.iter().product();
    let c = shape[axis];
    let es = std::mem::size_of::<T>();
    let add = fuse == Fuse::AddRelu;
    let per_call = (if add { 5 } else { 4 }) * n * es;
    let copies = (2 * L2_BYTES).div_ceil(per_call).clamp(1, 8);
    let xs = random::<T>(n, 1, -2.0, 3.0);
    let zs = random::<T>(n, 2, -1.0, 1.0);
    let dys = random::<T>(n, 3, -1.0, 1.0);
    let mut bufs: Vec<Bufs<T>> = (0..copies)
        .map(|_| -> Result<Bufs<T>> {
            Ok(Bufs {
                x: s.clone_htod(&xs)?,
                z: s.clone_htod(&zs)?,
                y: s.alloc_zeros(n)?,
                dy: s.clone_htod(&dys)?,
                dx: s.alloc_zeros(n)?,
                dz: s.alloc_zeros(n)?,
            })
        })
        .collect::<Result<_>>()?;
    let mut p = Params {
        g: s.clone_htod(&random::<f32>(c, 4, 0.5, 1.5))?,
        b: s.clone_htod(&random::<f32>(c, 5, -0.5, 0.5))?,
        rm: s.alloc_zeros(c)?,
        rv: s.clone_htod(&vec![1.0f32; c])?,
        dg: s.alloc_zeros(c)?,
        db: s.alloc_zeros(c)?,
    };
    let fwd_bytes = ((if add { 3 } else { 2 }) * n * es) as f64;
    let bwd_bytes = ((if add { 4 } else { 3 }) * n * es) as f64 + n as f64 / 8.0;
    let fwd_floor = fwd_bytes / bw * 1e6;
    let bwd_floor = bwd_bytes / bw * 1e6;
    let case = format!("{label} {shape:?} {}", fuse_name(fuse));

    let fused = BatchNorm::<T>::new(ctx, shape, axis, fuse)?;
    let fb = BatchNorm::<T>::new(fallback, shape, axis, fuse)?;
    let plain = BatchNorm::<T>::new(ctx, shape, axis, Fuse::None)?;

    // --- forward ---------------------------------------------------------------------------
    let forward = |bn: &BatchNorm<T>, b: &mut Bufs<T>, p: &mut Params| -> nnfuse::Result<BnSaved> {
        bn.forward_train(TrainArgs {
            x: b.x.as_view(),
            addend: add.then(|| b.z.as_view()),
            gamma: p.g.as_view(),
            beta: p.b.as_view(),
            running_mean: p.rm.as_view_mut(),
            running_var: p.rv.as_view_mut(),
            y: b.y.as_view_mut(),
            momentum: 0.1,
            eps: 1e-5,
        })
    };
    // Baseline: plain cuDNN BN, then a ReLU (Add+ReLU) in place that keeps y, no mask.
    let baseline_fwd = |b: &mut Bufs<T>, p: &mut Params| -> nnfuse::Result<BnSaved> {
        let saved = plain.forward_train(TrainArgs {
            x: b.x.as_view(),
            addend: None,
            gamma: p.g.as_view(),
            beta: p.b.as_view(),
            running_mean: p.rm.as_view_mut(),
            running_var: p.rv.as_view_mut(),
            y: b.y.as_view_mut(),
            momentum: 0.1,
            eps: 1e-5,
        })?;
        let none: Option<&mut CudaSlice<u32>> = None;
        if add {
            activation::add_relu_mask_fwd_inplace(ctx, &mut b.y, &b.z, none)?;
        } else {
            activation::relu_mask_fwd_inplace(ctx, &mut b.y, none)?;
        }
        Ok(saved)
    };
    let t_base = time_gpu(ctx, opts(), |i| {
        baseline_fwd(&mut bufs[i % copies], &mut p).map(drop)
    })?;
    report.row(
        &case,
        "fwd",
        "baseline",
        t_base.median_us(),
        fwd_floor,
        fwd_bytes,
        None,
    );
    let t_fb = time_gpu(ctx, opts(), |i| {
        forward(&fb, &mut bufs[i % copies], &mut p).map(drop)
    })?;
    report.row(
        &case,
        "fwd",
        "fallback",
        t_fb.median_us(),
        fwd_floor,
        fwd_bytes,
        Some(t_base.median_us()),
    );
    let has_fused = fused.training_path() == BnPath::CudnnFused;
    let mut t_fused_fwd = None;
    if has_fused {
        let t = time_gpu(ctx, opts(), |i| {
            forward(&fused, &mut bufs[i % copies], &mut p).map(drop)
        })?;
        report.row(
            &case,
            "fwd",
            "cudnn_fused",
            t.median_us(),
            fwd_floor,
            fwd_bytes,
            Some(t_base.median_us()),
        );
        t_fused_fwd = Some(t.median_us());
    }

    // --- backward --------------------------------------------------------------------------
    let backward = |bn: &BatchNorm<T>, b: &mut Bufs<T>, p: &mut Params, saved: &BnSaved| {
        bn.backward(BackwardArgs {
            x: b.x.as_view(),
            y: b.y.as_view(),
            dy: b.dy.as_view(),
            gamma: p.g.as_view(),
            beta: p.b.as_view(),
            saved,
            dx: b.dx.as_view_mut(),
            d_addend: add.then(|| b.dz.as_view_mut()),
            dgamma: p.dg.as_view_mut(),
            dbeta: p.db.as_view_mut(),
        })
    };
    // Baseline backward: ReLU backward from y into dz (the addend's gradient, or scratch),
    // then plain BN backward from it.
    let saved: Vec<BnSaved> = (0..copies)
        .map(|k| baseline_fwd(&mut bufs[k], &mut p))
        .collect::<nnfuse::Result<_>>()?;
    let t_base_b = time_gpu(ctx, opts(), |i| {
        let k = i % copies;
        let b = &mut bufs[k];
        activation::baseline::relu_bwd_from_y(ctx, &b.dy, &b.y, &mut b.dz)?;
        plain.backward(BackwardArgs {
            x: b.x.as_view(),
            y: b.y.as_view(),
            dy: b.dz.as_view(),
            gamma: p.g.as_view(),
            beta: p.b.as_view(),
            saved: &saved[k],
            dx: b.dx.as_view_mut(),
            d_addend: None,
            dgamma: p.dg.as_view_mut(),
            dbeta: p.db.as_view_mut(),
        })
    })?;
    drop(saved);
    report.row(
        &case,
        "bwd",
        "baseline",
        t_base_b.median_us(),
        bwd_floor,
        bwd_bytes,
        None,
    );
    let saved: Vec<BnSaved> = (0..copies)
        .map(|k| forward(&fb, &mut bufs[k], &mut p))
        .collect::<nnfuse::Result<_>>()?;
    let t_fb_b = time_gpu(ctx, opts(), |i| {
        let k = i % copies;
        backward(&fb, &mut bufs[k], &mut p, &saved[k])
    })?;
    drop(saved);
    report.row(
        &case,
        "bwd",
        "fallback",
        t_fb_b.median_us(),
        bwd_floor,
        bwd_bytes,
        Some(t_base_b.median_us()),
    );
    if let Some(tf) = t_fused_fwd {
        let saved: Vec<BnSaved> = (0..copies)
            .map(|k| forward(&fused, &mut bufs[k], &mut p))
            .collect::<nnfuse::Result<_>>()?;
        let t = time_gpu(ctx, opts(), |i| {
            let k = i % copies;
            backward(&fused, &mut bufs[k], &mut p, &saved[k])
        })?;
        report.row(
            &case,
            "bwd",
            "cudnn_fused",
            t.median_us(),
            bwd_floor,
            bwd_bytes,
            Some(t_base_b.median_us()),
        );
        let both = tf + t.median_us();
        let base = t_base.median_us() + t_base_b.median_us();
        report.row(
            &case,
            "fwd+bwd",
            "cudnn_fused",
            both,
            fwd_floor + bwd_floor,
            fwd_bytes + bwd_bytes,
            Some(base),
        );
    }
    let both = t_fb.median_us() + t_fb_b.median_us();
    let base = t_base.median_us() + t_base_b.median_us();
    report.row(
        &case,
        "fwd+bwd",
        "fallback",
        both,
        fwd_floor + bwd_floor,
        fwd_bytes + bwd_bytes,
        Some(base),
    );
    // nnfuse's own kernels (variants by the plan).
    let ob = BatchNorm::<T>::new(own, shape, axis, fuse)?;
    let t_own = time_gpu(ctx, opts(), |i| {
        forward(&ob, &mut bufs[i % copies], &mut p).map(drop)
    })?;
    let saved: Vec<BnSaved> = (0..copies)
        .map(|k| forward(&ob, &mut bufs[k], &mut p))
        .collect::<nnfuse::Result<_>>()?;
    let t_own_b = time_gpu(ctx, opts(), |i| {
        let k = i % copies;
        backward(&ob, &mut bufs[k], &mut p, &saved[k])
    })?;
    let variants = format!(
        "own ({}/{})",
        saved[0].own_variant().map_or("-", OwnVariant::name),
        ob.last_own_backward().map_or("-", OwnVariant::name)
    );
    drop(saved);
    report.row(
        &case,
        "fwd",
        &variants,
        t_own.median_us(),
        fwd_floor,
        fwd_bytes,
        Some(t_base.median_us()),
    );
    report.row(
        &case,
        "bwd",
        &variants,
        t_own_b.median_us(),
        bwd_floor,
        bwd_bytes,
        Some(t_base_b.median_us()),
    );
    report.row(
        &case,
        "fwd+bwd",
        &variants,
        t_own.median_us() + t_own_b.median_us(),
        fwd_floor + bwd_floor,
        fwd_bytes + bwd_bytes,
        Some(base),
    );
    if !has_fused {
        println!("  ({case}: no fused path: {:?})", fused.plan().refusals);
    }
    Ok(())
}

fn fuse_name(f: Fuse) -> &'static str {
    match f {
        Fuse::None => "bn",
        Fuse::Relu => "bn+relu",
        Fuse::AddRelu => "bn+add+relu",
    }
}

/// Plain BN forward and backward of one shape under `ctx`'s policy.
fn bench_plain<T: Element>(
    ctx: &Context,
    shape: &[usize],
    axis: usize,
    bw: f64,
    label: &str,
    report: &mut Report,
) -> Result<()> {
    let s = ctx.stream();
    let n: usize = shape.iter().product();
    let c = shape[axis];
    let es = std::mem::size_of::<T>();
    let copies = (2 * L2_BYTES).div_ceil(4 * n * es).clamp(1, 8);
    let xs = random::<T>(n, 7, -2.0, 3.0);
    let mut bufs: Vec<Bufs<T>> = (0..copies)
        .map(|_| -> Result<Bufs<T>> {
            Ok(Bufs {
                x: s.clone_htod(&xs)?,
                z: s.alloc_zeros(1)?,
                y: s.alloc_zeros(n)?,
                dy: s.clone_htod(&xs)?,
                dx: s.alloc_zeros(n)?,
                dz: s.alloc_zeros(1)?,
            })
        })
        .collect::<Result<_>>()?;
    let mut p = Params {
        g: s.clone_htod(&vec![1.0f32; c])?,
        b: s.alloc_zeros(c)?,
        rm: s.alloc_zeros(c)?,
        rv: s.clone_htod(&vec![1.0f32; c])?,
        dg: s.alloc_zeros(c)?,
        db: s.alloc_zeros(c)?,
    };
    let bn = BatchNorm::<T>::new(ctx, shape, axis, Fuse::None)?;
    let fwd = |b: &mut Bufs<T>, p: &mut Params| {
        bn.forward_train(TrainArgs {
            x: b.x.as_view(),
            addend: None,
            gamma: p.g.as_view(),
            beta: p.b.as_view(),
            running_mean: p.rm.as_view_mut(),
            running_var: p.rv.as_view_mut(),
            y: b.y.as_view_mut(),
            momentum: 0.1,
            eps: 1e-5,
        })
    };
    let t = time_gpu(ctx, opts(), |i| {
        fwd(&mut bufs[i % copies], &mut p).map(drop)
    })?;
    let case = format!("{label} {shape:?} mode={}", bn.plan().mode.name());
    let fb = (2 * n * es) as f64;
    report.row(
        &case,
        "fwd",
        "plain",
        t.median_us(),
        fb / bw * 1e6,
        fb,
        None,
    );
    let saved: Vec<BnSaved> = (0..copies)
        .map(|k| fwd(&mut bufs[k], &mut p))
        .collect::<nnfuse::Result<_>>()?;
    let t = time_gpu(ctx, opts(), |i| {
        let k = i % copies;
        let b = &mut bufs[k];
        bn.backward(BackwardArgs {
            x: b.x.as_view(),
            y: b.y.as_view(),
            dy: b.dy.as_view(),
            gamma: p.g.as_view(),
            beta: p.b.as_view(),
            saved: &saved[k],
            dx: b.dx.as_view_mut(),
            d_addend: None,
            dgamma: p.dg.as_view_mut(),
            dbeta: p.db.as_view_mut(),
        })
    })?;
    let bb = (3 * n * es) as f64;
    report.row(
        &case,
        "bwd",
        "plain",
        t.median_us(),
        bb / bw * 1e6,
        bb,
        None,
    );
    Ok(())
}

// ----- nnfuse's own kernels (issue 9) -----------------------------------------------------------

/// PyTorch 2.11's times on the H100 for the cases, measured earlier (issue 9's table,
/// fwd / bwd µs; inference: one number), with the nnfuse-on-cuDNN times of the same table.
struct Earlier {
    pytorch: (f64, f64),
    nnfuse_cudnn: (f64, f64),
}

fn setup<T: Element>(
    ctx: &Context,
    shape: &[usize],
    axis: usize,
) -> Result<(Vec<Bufs<T>>, Params)> {
    let s = ctx.stream();
    let n: usize = shape.iter().product();
    let c = shape[axis];
    let es = std::mem::size_of::<T>();
    let copies = (2 * L2_BYTES).div_ceil(5 * n * es).clamp(1, 8);
    let xs = random::<T>(n, 11, -2.0, 3.0);
    let zs = random::<T>(n, 12, -1.0, 1.0);
    let dys = random::<T>(n, 13, -1.0, 1.0);
    let bufs = (0..copies)
        .map(|_| -> Result<Bufs<T>> {
            Ok(Bufs {
                x: s.clone_htod(&xs)?,
                z: s.clone_htod(&zs)?,
                y: s.alloc_zeros(n)?,
                dy: s.clone_htod(&dys)?,
                dx: s.alloc_zeros(n)?,
                dz: s.alloc_zeros(n)?,
            })
        })
        .collect::<Result<_>>()?;
    let p = Params {
        g: s.clone_htod(&random::<f32>(c, 14, 0.5, 1.5))?,
        b: s.clone_htod(&random::<f32>(c, 15, -0.5, 0.5))?,
        rm: s.alloc_zeros(c)?,
        rv: s.clone_htod(&vec![1.0f32; c])?,
        dg: s.alloc_zeros(c)?,
        db: s.alloc_zeros(c)?,
    };
    Ok((bufs, p))
}

/// Training forward and backward of `bn` (median µs each) on rotating buffers, with the own
/// variants that ran.
fn time_train<T: Element>(
    timer: &Context,
    bn: &BatchNorm<T>,
    fuse: Fuse,
    bufs: &mut [Bufs<T>],
    p: &mut Params,
) -> Result<(f64, f64, String)> {
    let copies = bufs.len();
    let add = fuse == Fuse::AddRelu;
    let fwd = |b: &mut Bufs<T>, p: &mut Params| {
        bn.forward_train(TrainArgs {
            x: b.x.as_view(),
            addend: add.then(|| b.z.as_view()),
            gamma: p.g.as_view(),
            beta: p.b.as_view(),
            running_mean: p.rm.as_view_mut(),
            running_var: p.rv.as_view_mut(),
            y: b.y.as_view_mut(),
            momentum: 0.1,
            eps: 1e-5,
        })
    };
    let tf = time_gpu(timer, opts(), |i| fwd(&mut bufs[i % copies], p).map(drop))?;
    let saved: Vec<BnSaved> = (0..copies)
        .map(|k| fwd(&mut bufs[k], p))
        .collect::<nnfuse::Result<_>>()?;
    let tb = time_gpu(timer, opts(), |i| {
        let k = i % copies;
        let b = &mut bufs[k];
        bn.backward(BackwardArgs {
            x: b.x.as_view(),
            y: b.y.as_view(),
            dy: b.dy.as_view(),
            gamma: p.g.as_view(),
            beta: p.b.as_view(),
            saved: &saved[k],
            dx: b.dx.as_view_mut(),
            d_addend: add.then(|| b.dz.as_view_mut()),
            dgamma: p.dg.as_view_mut(),
            dbeta: p.db.as_view_mut(),
        })
    })?;
    let how = match saved[0].own_variant() {
        Some(v) => format!(
            "own {}/{}",
            v.name(),
            bn.last_own_backward().map_or("-", OwnVariant::name)
        ),
        None => saved[0].path().name().to_string(),
    };
    Ok((tf.median_us(), tb.median_us(), how))
}

/// Bytes a training forward / backward must move at least (x and the addend read, y written,
/// the mask written; x, dy and the mask read, dx and the addend's gradient written).
fn floor_bytes(n: usize, es: usize, fuse: Fuse) -> (f64, f64) {
    let add = fuse == Fuse::AddRelu;
    let mask = if fuse == Fuse::None {
        0.0
    } else {
        n as f64 / 8.0
    };
    let fwd = ((if add { 3 } else { 2 }) * n * es) as f64 + mask;
    let bwd = ((if add { 4 } else { 3 }) * n * es) as f64 + mask;
    (fwd, bwd)
}

/// The bytes the own variants move: two-pass reads x twice forward, x and dy (and the mask)
/// twice backward; persistent moves the floor's bytes.
fn own_bytes(
    n: usize,
    es: usize,
    fuse: Fuse,
    fwd_persistent: bool,
    bwd_persistent: bool,
) -> (f64, f64) {
    let (f, b) = floor_bytes(n, es, fuse);
    let mask = if fuse == Fuse::None {
        0.0
    } else {
        n as f64 / 8.0
    };
    let x = (n * es) as f64;
    (
        if fwd_persistent { f } else { f + x },
        if bwd_persistent {
            b
        } else {
            b + 2.0 * x + mask
        },
    )
}

/// µs of a device-to-device copy moving `bytes` (half read, half written): small tensors do not
/// reach the 1 GiB copy's bandwidth either, so the own kernels are also compared with this.
fn same_size_copy_us(ctx: &Context, bytes: f64) -> Result<f64> {
    Ok(bytes / copy_bandwidth(ctx, (bytes / 2.0) as usize)? * 1e6)
}

#[allow(clippy::too_many_arguments)]
fn bench_own_training<T: Element>(
    cudnn: &Context,
    own: &Context,
    shape: &[usize],
    axis: usize,
    fuse: Fuse,
    label: &str,
    earlier: Option<Earlier>,
    bw: f64,
    summary: &mut Vec<String>,
) -> Result<()> {
    let n: usize = shape.iter().product();
    let es = std::mem::size_of::<T>();
    let (mut bufs, mut p) = setup::<T>(cudnn, shape, axis)?;
    let cbn = BatchNorm::<T>::new(cudnn, shape, axis, fuse)?;
    let (cf, cb, cpath) = time_train(cudnn, &cbn, fuse, &mut bufs, &mut p)?;
    let obn = BatchNorm::<T>::new(own, shape, axis, fuse)?;
    let (of, ob, how) = time_train(cudnn, &obn, fuse, &mut bufs, &mut p)?;
    let (ff, fb) = floor_bytes(n, es, fuse);
    let floor_us = (ff + fb) / bw * 1e6;
    let pf = how.contains("own persistent");
    let pb = how.ends_with("/persistent");
    let (bf, bb) = own_bytes(n, es, fuse, pf, pb);
    let copy_pct_f = 100.0 * bf / (of * 1e-6) / bw;
    let copy_pct_b = 100.0 * bb / (ob * 1e-6) / bw;
    let (scf, scb) = (same_size_copy_us(own, bf)?, same_size_copy_us(own, bb)?);
    let own_total = of + ob;
    let case = format!("{label} {shape:?} {}", fuse_name(fuse));
    let (pt, nc) = match &earlier {
        Some(e) => (
            format!(
                "{:.0} / {:.0} ({:.2}x)",
                e.pytorch.0,
                e.pytorch.1,
                (e.pytorch.0 + e.pytorch.1) / own_total
            ),
            format!("{:.0} / {:.0}", e.nnfuse_cudnn.0, e.nnfuse_cudnn.1),
        ),
        None => ("-".into(), "-".into()),
    };
    let line = format!(
        "| {case} | {how} | {of:.1} / {ob:.1} | {cpath} {cf:.1} / {cb:.1} | {:.2}x | {pt} | {nc} | {floor_us:.1} | {:.0}% | {copy_pct_f:.0}% / {copy_pct_b:.0}% | {:.0}% / {:.0}% |",
        (cf + cb) / own_total,
        100.0 * floor_us / own_total,
        100.0 * scf / of,
        100.0 * scb / ob
    );
    println!("{line}");
    println!(
        "{{\"bench\":\"batchnorm\",\"section\":\"own_training\",\"case\":\"{case}\",\"own\":\"{how}\",\"own_fwd_us\":{of:.2},\"own_bwd_us\":{ob:.2},\"cudnn_path\":\"{cpath}\",\"cudnn_fwd_us\":{cf:.2},\"cudnn_bwd_us\":{cb:.2},\"floor_us\":{floor_us:.2},\"own_copy_pct_fwd\":{copy_pct_f:.1},\"own_copy_pct_bwd\":{copy_pct_b:.1},\"same_size_copy_fwd_us\":{scf:.2},\"same_size_copy_bwd_us\":{scb:.2},\"pytorch_fwd_us\":{},\"pytorch_bwd_us\":{}}}",
        earlier.as_ref().map_or("null".into(), |e| e.pytorch.0.to_string()),
        earlier.as_ref().map_or("null".into(), |e| e.pytorch.1.to_string()),
    );
    summary.push(line);
    Ok(())
}

const OWN_TRAIN_HEADER: &str = "| case | own variants (fwd/bwd) | own fwd / bwd µs | cuDNN path fwd / bwd µs | own speed-up vs cuDNN | PyTorch fwd / bwd µs (earlier H100 measurement) and own speed-up | nnfuse on cuDNN fwd / bwd µs (earlier H100 measurement) | floor fwd+bwd µs | own % of floor | own % of copy, its bytes (fwd / bwd) | own % of a same-size copy (fwd / bwd) |\n|---|---|---|---|---|---|---|---|---|---|---|";

/// Inference: the own one-pass kernel against cuDNN's ForwardInference plus the activation
/// kernel, effective bandwidth on the bytes moved (x, the addend, y).
#[allow(clippy::too_many_arguments)]
fn bench_own_inference<T: Element>(
    cudnn: &Context,
    own: &Context,
    shape: &[usize],
    axis: usize,
    fuse: Fuse,
    label: &str,
    earlier: Option<f64>,
    bw: f64,
    summary: &mut Vec<String>,
) -> Result<()> {
    let n: usize = shape.iter().product();
    let es = std::mem::size_of::<T>();
    let (mut bufs, p) = setup::<T>(cudnn, shape, axis)?;
    let copies = bufs.len();
    let add = fuse == Fuse::AddRelu;
    let mut time = |ctx: &Context| -> Result<f64> {
        let bn = BatchNorm::<T>::new(ctx, shape, axis, fuse)?;
        let t = time_gpu(cudnn, opts(), |i| {
            let b = &mut bufs[i % copies];
            bn.forward_inference(InferenceArgs {
                x: b.x.as_view(),
                addend: add.then(|| b.z.as_view()),
                gamma: p.g.as_view(),
                beta: p.b.as_view(),
                running_mean: p.rm.as_view(),
                running_var: p.rv.as_view(),
                y: b.y.as_view_mut(),
                eps: 1e-5,
            })
        })?;
        Ok(t.median_us())
    };
    let tc = time(cudnn)?;
    let to = time(own)?;
    let bytes = ((if add { 3 } else { 2 }) * n * es) as f64;
    let tbs = bytes / (to * 1e-6) / 1e12;
    let copy_us = same_size_copy_us(own, bytes)?;
    let case = format!("{label} {shape:?} {}", fuse_name(fuse));
    let line = format!(
        "| {case} | {to:.1} | {tbs:.2} TB/s ({:.0}% of copy) | {copy_us:.1} ({:.0}%) | {tc:.1} | {:.2}x | {} | {:.1} |",
        100.0 * tbs * 1e12 / bw,
        100.0 * copy_us / to,
        tc / to,
        earlier.map_or("-".into(), |e| format!("{e:.0} ({:.2}x)", e / to)),
        bytes / bw * 1e6
    );
    println!("{line}");
    println!(
        "{{\"bench\":\"batchnorm\",\"section\":\"own_inference\",\"case\":\"{case}\",\"own_us\":{to:.2},\"own_tbs\":{tbs:.3},\"same_size_copy_us\":{copy_us:.2},\"cudnn_us\":{tc:.2},\"floor_us\":{:.2},\"pytorch_us\":{}}}",
        bytes / bw * 1e6,
        earlier.map_or("null".into(), |e| e.to_string())
    );
    summary.push(line);
    Ok(())
}

const OWN_INFER_HEADER: &str = "| case | own µs | own effective bandwidth (vs the 1 GiB copy) | same-size copy µs (own at % of its speed) | cuDNN + activation µs | own speed-up | PyTorch µs (earlier H100 measurement) and own speed-up | floor µs |\n|---|---|---|---|---|---|---|---|";

/// The own persistent variant against the own two-pass variant (both forced) and the cuDNN
/// path, on tensors that fit on chip.
#[allow(clippy::too_many_arguments)]
fn bench_variants<T: Element>(
    cudnn: &Context,
    own: &Context,
    shape: &[usize],
    axis: usize,
    fuse: Fuse,
    label: &str,
    bw: f64,
    summary: &mut Vec<String>,
) -> Result<()> {
    let n: usize = shape.iter().product();
    let es = std::mem::size_of::<T>();
    let (mut bufs, mut p) = setup::<T>(cudnn, shape, axis)?;
    let cbn = BatchNorm::<T>::new(cudnn, shape, axis, fuse)?;
    let (cf, cb, cpath) = time_train(cudnn, &cbn, fuse, &mut bufs, &mut p)?;
    let with = |v| BnOptions { own_variant: v };
    let two =
        BatchNorm::<T>::with_options(own, shape, axis, fuse, with(OwnVariantChoice::TwoPass))?;
    let (tf, tb, thow) = time_train(cudnn, &two, fuse, &mut bufs, &mut p)?;
    let per =
        BatchNorm::<T>::with_options(own, shape, axis, fuse, with(OwnVariantChoice::Persistent))?;
    let (pf, pb, phow) = time_train(cudnn, &per, fuse, &mut bufs, &mut p)?;
    let (ff, fb) = floor_bytes(n, es, fuse);
    let case = format!("{label} {shape:?} {}", fuse_name(fuse));
    let line = format!(
        "| {case} | {thow} {tf:.1} / {tb:.1} | {phow} {pf:.1} / {pb:.1} | {:.2}x / {:.2}x | {cpath} {cf:.1} / {cb:.1} | {:.1} / {:.1} |",
        tf / pf,
        tb / pb,
        ff / bw * 1e6,
        fb / bw * 1e6
    );
    println!("{line}");
    println!(
        "{{\"bench\":\"batchnorm\",\"section\":\"own_variants\",\"case\":\"{case}\",\"two_pass\":\"{thow}\",\"two_pass_fwd_us\":{tf:.2},\"two_pass_bwd_us\":{tb:.2},\"persistent\":\"{phow}\",\"persistent_fwd_us\":{pf:.2},\"persistent_bwd_us\":{pb:.2},\"cudnn_fwd_us\":{cf:.2},\"cudnn_bwd_us\":{cb:.2}}}"
    );
    summary.push(line);
    Ok(())
}

const OWN_VARIANTS_HEADER: &str = "| case | own two-pass fwd / bwd µs | own persistent fwd / bwd µs | persistent speed-up fwd / bwd | cuDNN path fwd / bwd µs | floor fwd / bwd µs |\n|---|---|---|---|---|---|";

fn own_sections(ctx: &Context, own: &Context, bw: f64) -> Result<()> {
    let mut train = Vec::new();
    println!(
        "\n## nnfuse's own kernels: the ResNet cases of the own-kernel targets (training, fwd + bwd)\n\n{OWN_TRAIN_HEADER}"
    );
    let e = |pf, pb, nf, nb| {
        Some(Earlier {
            pytorch: (pf, pb),
            nnfuse_cudnn: (nf, nb),
        })
    };
    bench_own_training::<f16>(
        ctx,
        own,
        &[64, 64, 112, 112],
        1,
        Fuse::Relu,
        "f16 NCHW",
        e(679.0, 1271.0, 685.0, 1244.0),
        bw,
        &mut train,
    )?;
    bench_own_training::<f16>(
        ctx,
        own,
        &[64, 64, 112, 112],
        1,
        Fuse::AddRelu,
        "f16 NCHW",
        None,
        bw,
        &mut train,
    )?;
    bench_own_training::<f32>(
        ctx,
        own,
        &[16, 32, 112, 112],
        1,
        Fuse::Relu,
        "f32 NCHW",
        e(133.0, 329.0, 134.0, 321.0),
        bw,
        &mut train,
    )?;
    bench_own_training::<f32>(
        ctx,
        own,
        &[16, 32, 112, 112],
        1,
        Fuse::AddRelu,
        "f32 NCHW",
        None,
        bw,
        &mut train,
    )?;
    bench_own_training::<f16>(
        ctx,
        own,
        &[64, 112, 112, 64],
        3,
        Fuse::Relu,
        "f16 NHWC",
        e(184.0, 282.0, 118.0, 180.0),
        bw,
        &mut train,
    )?;
    bench_own_training::<f16>(
        ctx,
        own,
        &[64, 56, 56, 256],
        3,
        Fuse::AddRelu,
        "f16 NHWC",
        e(308.0, 280.0, 199.0, 225.0),
        bw,
        &mut train,
    )?;
    bench_own_training::<f32>(
        ctx,
        own,
        &[65536, 256],
        1,
        Fuse::None,
        "f32 2-D",
        None,
        bw,
        &mut train,
    )?;
    bench_own_training::<f32>(
        ctx,
        own,
        &[65536, 256],
        1,
        Fuse::Relu,
        "f32 2-D",
        None,
        bw,
        &mut train,
    )?;
    bench_own_training::<f16>(
        ctx,
        own,
        &[64, 1024, 14, 14],
        1,
        Fuse::Relu,
        "f16 NCHW",
        None,
        bw,
        &mut train,
    )?;

    let mut infer = Vec::new();
    println!("\n## nnfuse's own kernels: inference 64x256x56x56, every type and layout\n\n{OWN_INFER_HEADER}");
    macro_rules! infer_all {
        ($t:ty, $name:literal) => {
            for fuse in [Fuse::Relu, Fuse::AddRelu] {
                let nchw_e = if $name == "f32" && fuse == Fuse::Relu {
                    Some(311.0)
                } else {
                    None
                };
                let nhwc_e = if $name == "f16" && fuse == Fuse::AddRelu {
                    Some(335.0)
                } else {
                    None
                };
                bench_own_inference::<$t>(
                    ctx,
                    own,
                    &[64, 256, 56, 56],
                    1,
                    fuse,
                    concat!($name, " NCHW"),
                    nchw_e,
                    bw,
                    &mut infer,
                )?;
                bench_own_inference::<$t>(
                    ctx,
                    own,
                    &[64, 56, 56, 256],
                    3,
                    fuse,
                    concat!($name, " NHWC"),
                    nhwc_e,
                    bw,
                    &mut infer,
                )?;
            }
        };
    }
    infer_all!(f32, "f32");
    infer_all!(f16, "f16");
    infer_all!(bf16, "bf16");

    let mut vars = Vec::new();
    println!("\n## nnfuse's own kernels: persistent against two-pass (tensors that fit on chip)\n\n{OWN_VARIANTS_HEADER}");
    bench_variants::<f16>(
        ctx,
        own,
        &[16, 32, 112, 112],
        1,
        Fuse::Relu,
        "f16 NCHW",
        bw,
        &mut vars,
    )?;
    bench_variants::<f32>(
        ctx,
        own,
        &[8, 32, 56, 56],
        1,
        Fuse::Relu,
        "f32 NCHW",
        bw,
        &mut vars,
    )?;
    bench_variants::<f16>(
        ctx,
        own,
        &[16, 112, 112, 32],
        3,
        Fuse::Relu,
        "f16 NHWC",
        bw,
        &mut vars,
    )?;
    bench_variants::<f16>(
        ctx,
        own,
        &[16, 56, 56, 64],
        3,
        Fuse::AddRelu,
        "f16 NHWC",
        bw,
        &mut vars,
    )?;
    bench_variants::<f32>(
        ctx,
        own,
        &[16384, 256],
        1,
        Fuse::Relu,
        "f32 2-D",
        bw,
        &mut vars,
    )?;

    println!("\n## Summary: own kernels\n\n{OWN_TRAIN_HEADER}");
    for l in &train {
        println!("{l}");
    }
    println!("\n{OWN_INFER_HEADER}");
    for l in &infer {
        println!("{l}");
    }
    println!("\n{OWN_VARIANTS_HEADER}");
    for l in &vars {
        println!("{l}");
    }
    Ok(())
}

/// The cuDNN API for training BatchNorm: the graph's NORM_FORWARD / NORM_BACKWARD plans
/// (NNFUSE_CUDNN_API=graph, replayed from CUDA graphs as a framework's repeated calls are) against
/// the legacy Ex calls, on channels-last halves (cuDNN's documented support): plain, and the
/// demo's BN+ReLU (64 channels) and BN+Add+ReLU (256) with every path. Where cuDNN cannot build
/// the graph the legacy calls run instead (a `tracing` warning says so: NNFUSE_LOG=nnfuse=warn).
/// `NNFUSE_BENCH_BN=api` runs only this section.
fn api_section(ctx: &Context, own: &Context, bw: f64, report: &mut Report) -> Result<()> {
    println!("\n## Training BatchNorm by cuDNN API (channels-last)\n\n{HEADER}");
    for api in [CudnnApi::Legacy, CudnnApi::Graph] {
        let config = Config::default()
            .with_bn_impl(BnImpl::Cudnn)
            .with_cudnn_api(api);
        let actx = ctx.with_config_override(config.clone());
        let fallback = ctx.with_config_override(config.with_cudnn_fusion_disabled(true));
        let tag = format!("cudnn_api={api}");
        for shape in [[16, 112, 112, 32], [64, 56, 56, 256]] {
            bench_plain::<f16>(&actx, &shape, 3, bw, &format!("{tag} f16 NHWC"), report)?;
            bench_plain::<bf16>(&actx, &shape, 3, bw, &format!("{tag} bf16 NHWC"), report)?;
        }
        for (c, fuse) in [(64, Fuse::Relu), (256, Fuse::AddRelu)] {
            let label = format!("{tag} f16 NHWC");
            let shape = [32, 56, 56, c];
            bench_case::<f16>(&actx, &fallback, own, &shape, 3, fuse, bw, &label, report)?;
        }
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    exit::finish("batchnorm", run())
}

fn run() -> Result<()> {
    // The cuDNN paths are pinned (bn_impl = cudnn); `own` runs nnfuse's own kernels on the
    // same stream.
    let ctx = Context::with_config(0, Config::default().with_bn_impl(BnImpl::Cudnn))?;
    let fallback = ctx.with_config_override(
        Config::default()
            .with_bn_impl(BnImpl::Cudnn)
            .with_cudnn_fusion_disabled(true),
    );
    let own = ctx.with_config_override(Config::default().with_bn_impl(BnImpl::Own));
    println!("# nnfuse BatchNorm benchmark\n{}", ctx.info());
    println!(
        "cuDNN {}",
        nnfuse::context::cudnn_version().map_or("?".into(), |v| v.to_string())
    );
    let bw = copy_bandwidth(&ctx, 1 << 30)?;
    println!(
        "measured device-to-device copy bandwidth: {:.3} TB/s (read + write)\n",
        bw / 1e12
    );
    let mut report = Report::default();
    println!("{HEADER}");
    // NNFUSE_BENCH_BN=demo (or demo64, demo256): only `nnfuse demo`'s BatchNorm shapes (f16
    // NHWC, batch 32), for a quick comparison of one kernel change (or a profiler run).
    let only = std::env::var("NNFUSE_BENCH_BN").unwrap_or_default();
    if only == "api" {
        return api_section(&ctx, &own, bw, &mut report);
    }
    if only.starts_with("demo") {
        for (c, fuse) in [(64, Fuse::Relu), (256, Fuse::AddRelu)] {
            if only != "demo" && only != format!("demo{c}") {
                continue;
            }
            bench_case::<f16>(
                &ctx,
                &fallback,
                &own,
                &[32, 56, 56, c],
                3,
                fuse,
                bw,
                "f16 NHWC",
                &mut report,
            )?;
        }
        return Ok(());
    }
    const SHAPES: [(usize, usize, usize, usize); 5] = [
        (16, 32, 112, 112),
        (64, 64, 112, 112),
        (64, 256, 56, 56),
        (64, 512, 28, 28),
        (64, 1024, 14, 14),
    ];
    for (n, c, h, w) in SHAPES {
        for fuse in [Fuse::Relu, Fuse::AddRelu] {
            bench_case::<f16>(
                &ctx,
                &fallback,
                &own,
                &[n, h, w, c],
                3,
                fuse,
                bw,
                "f16 NHWC",
                &mut report,
            )?;
            bench_case::<f32>(
                &ctx,
                &fallback,
                &own,
                &[n, c, h, w],
                1,
                fuse,
                bw,
                "f32 NCHW",
                &mut report,
            )?;
        }
    }

    println!("\n## Plain BatchNorm by mode policy (2-D input, channels-first)\n\n{HEADER}");
    for policy in [
        BnModePolicy::OneFlow,
        BnModePolicy::Auto,
        BnModePolicy::Fast,
    ] {
        let pctx = ctx.with_config_override(
            Config::default()
                .with_bn_mode_policy(policy)
                .with_bn_impl(BnImpl::Cudnn),
        );
        let tag = format!("policy={}", policy.name());
        for (rows, cols) in [(65536, 256), (4096, 1024)] {
            bench_plain::<f32>(
                &pctx,
                &[rows, cols],
                1,
                bw,
                &format!("{tag} f32 2-D"),
                &mut report,
            )?;
            bench_plain::<f16>(
                &pctx,
                &[rows, cols],
                1,
                bw,
                &format!("{tag} f16 2-D"),
                &mut report,
            )?;
        }
        if policy != BnModePolicy::OneFlow {
            for shape in [[16, 32, 112, 112], [64, 64, 112, 112]] {
                bench_plain::<f32>(
                    &pctx,
                    &shape,
                    1,
                    bw,
                    &format!("{tag} f32 NCHW"),
                    &mut report,
                )?;
            }
        }
    }

    api_section(&ctx, &own, bw, &mut report)?;

    own_sections(&ctx, &own, bw)?;

    // Host-side dispatch cost of a repeated shape: the plan and descriptors come from the
    // Context's cache.
    let iters = 100_000;
    let t = Instant::now();
    for _ in 0..iters {
        let bn = BatchNorm::<f16>::new(&ctx, &[64, 56, 56, 256], 3, Fuse::AddRelu)?;
        std::hint::black_box(&bn);
    }
    let us = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
    println!(
        "\ndispatch: BatchNorm::new on a repeated shape (plan + descriptors cached): {us:.3} µs"
    );
    println!("{{\"bench\":\"batchnorm\",\"case\":\"dispatch_cached_new\",\"us\":{us:.4}}}");
    Ok(())
}
